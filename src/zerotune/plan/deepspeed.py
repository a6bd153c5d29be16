"""The DeepSpeed dict: composed from the config groups' fragments and derived values (offload blocks, NVMe checks,
swap-buffer sizes), then checked before anything is built: the project's rules, then DeepSpeed's own classes."""

from __future__ import annotations

import copy
import difflib
import inspect
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Any

from zerotune.config.deepspeed_blocks import (
    DEEPSPEED_TYPES,
    Known,
    check_client,
    check_params,
    check_supported,
    client_spec,
    is_client,
    normalize,
    scheduler_block,
    solve,
)
from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config, DeepSpeed, Offload, Optimizer, Precision, as_dict
from zerotune.host.platform import Platform, file_system, write_probe
from zerotune.models import ModelStats, text_encoders

# DeepSpeed's own default parameter swap buffer (100M elements).
DEFAULT_PARAM_BUFFER = 100_000_000


def param_buffer_size(largest_param_numel: int) -> int:
    """A parameter swap buffer must hold the largest single parameter; round up to 1M elements."""
    need = max(DEFAULT_PARAM_BUFFER, int(largest_param_numel))
    return -(-need // 1_000_000) * 1_000_000


def offload_blocks(offload: Offload, stage: int, largest_param_numel: int) -> dict:
    """The `offload_optimizer` / `offload_param` entries of `zero_optimization`."""
    if offload.device == "none":
        return {}
    pin = bool(offload.pin_memory)
    blocks: dict = {"offload_optimizer": {"device": offload.device, "pin_memory": pin}}
    # `params: auto` means: offload parameters wherever DeepSpeed can (stage 3)
    if stage == 3 if offload.params == "auto" else bool(offload.params):
        blocks["offload_param"] = {"device": offload.device, "pin_memory": pin}
    if offload.device == "nvme":
        path = None if offload.path is None else str(offload.path)
        blocks["offload_optimizer"].update({"nvme_path": path, "buffer_count": 4, "fast_init": False})
        if "offload_param" in blocks:
            size = offload.buffer_size
            blocks["offload_param"].update({
                "nvme_path": path,
                "buffer_count": int(offload.buffer_count),
                "buffer_size": param_buffer_size(largest_param_numel) if size == "auto" else int(size),
                "max_in_cpu": int(offload.max_in_cpu),
            })
    return blocks


def check_nvme_path(path: str | None, key: str) -> Path:
    """The NVMe folder must be given, be a folder (or be creatable inside an existing one), and take files."""
    if not path:
        raise ConfigError(key, "NVMe offload needs a folder to swap to", "offload.path=/path/to/nvme/folder")
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(key, f"{folder} is not a folder", "point offload.path at a folder")
    if not folder.exists() and not folder.parent.is_dir():
        raise ConfigError(key, f"{folder} does not exist, nor does its parent {folder.parent}",
                          "create the folder, or point offload.path at an existing one")
    # Do what DeepSpeed will (create the folder if missing, then a file in it) and undo it.
    created = not folder.exists()
    exc = write_probe(folder)
    if exc is None:
        return folder
    what = f"{folder} cannot be created in {folder.parent}" if created and not folder.is_dir() \
        else f"no file can be created in {folder}"
    where = folder if folder.is_dir() else folder.parent
    raise ConfigError(key, f"{what}: {exc.strerror} ({where} is on {file_system(where)})",
                      "point offload.path at a folder you can write to on a local disk (ideally NVMe)")


AIO_BLOCK = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
             "overlap_events": True}


def optimizer_block(opt: Optimizer) -> dict:
    name = normalize(opt.name)
    # The schema gives every optimizer every key; an option's unused ones are null and not DeepSpeed's.
    params = {k: (list(v) if k == "betas" else v) for k, v in as_dict(opt).items() if k != "name" and v is not None}
    return {"type": DEEPSPEED_TYPES[name], "params": params}


def client_optimizer(opt: Optimizer) -> dict | None:
    """The client optimizer the worker builds ({"name", "class", "params"}), or None: DeepSpeed builds its own."""
    return client_spec(normalize(opt.name), as_dict(opt)) if is_client(opt.name) else None


def precision_blocks(prec: Precision) -> dict:
    if prec.name == "bf16":
        return {"bf16": {"enabled": True}}
    if prec.name == "fp16":
        # DeepSpeed's own loss-scaling defaults where the precision came from a user's file, not fp16.yaml.
        return {"fp16": {"enabled": True, "initial_scale_power": int(prec.initial_scale_power),
                         "loss_scale_window": int(prec.loss_scale_window),
                         "hysteresis": int(prec.hysteresis),
                         "min_loss_scale": float(prec.min_loss_scale)}}
    return {}


# DeepSpeed's own defaults, in elements.
DEFAULT_BUCKETS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000}


def bucket_size(ds: DeepSpeed, key: str, stats: ModelStats) -> int:
    """A configured size, or for `auto` DeepSpeed's default capped at what the bucket can hold (rounded up
    to 1M): gradients and updated weights of the trained parameters, or any parameter for stage 3's prefetch."""
    value = getattr(ds, key)
    if value != "auto":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)) or not str(value).isdigit() \
                and not (isinstance(value, float) and value.is_integer() and value >= 0):
            raise ConfigError(f"deepspeed.{key}", f"a bucket size is a whole number of elements, or auto; got "
                              f"{value!r}", f"deepspeed.{key}=auto, e.g. deepspeed.{key}={DEFAULT_BUCKETS[key]}")
        return int(value)
    count = stats.num_params if key == "stage3_prefetch_bucket_size" else stats.num_trainable
    return min(DEFAULT_BUCKETS[key], -(-count // 1_000_000) * 1_000_000)


def zero_block(cfg: Config, stats: ModelStats) -> dict:
    stage, ds = cfg.zero_stage.stage, cfg.deepspeed
    zero: dict = {"stage": stage}
    if stage >= 1:
        zero.update({"reduce_bucket_size": bucket_size(ds, "reduce_bucket_size", stats), "reduce_scatter": True,
                     "overlap_comm": bool(ds.overlap_comm)})
    if stage in (1, 2):
        zero.update({"allgather_bucket_size": bucket_size(ds, "allgather_bucket_size", stats),
                     "contiguous_gradients": bool(ds.contiguous_gradients)})
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": bucket_size(ds, "stage3_prefetch_bucket_size", stats),
                     "stage3_param_persistence_threshold": int(ds.stage3_param_persistence_threshold),
                     "contiguous_gradients": bool(ds.contiguous_gradients),
                     "stage3_gather_16bit_weights_on_model_save":
                         bool(ds.stage3_gather_16bit_weights_on_model_save)})
    zero.update(offload_blocks(cfg.offload, stage, stats.largest_param_numel))
    return zero


def choose_adam(ds: dict, cfg: Config) -> None:
    """Apply `deepspeed.torch_adam` to an Adam/AdamW block, generated or the user's, unless it says itself.
    `auto`: torch's AdamW wherever DeepSpeed would otherwise JIT-build its fused kernel for no gain (no offload)."""
    opt = ds.get("optimizer")
    if not isinstance(opt, dict) or normalize(str(opt.get("type", "")), key="optimizer.type") not in ("adam", "adamw"):
        return
    setting = cfg.deepspeed.torch_adam
    params = opt.setdefault("params", {})
    if "torch_adam" not in params and (cfg.offload.device == "none" if setting == "auto" else bool(setting)):
        params["torch_adam"] = True


def build(cfg: Config, world_size: int, stats: ModelStats, given: Collection[str] = ()) -> dict:
    """The DeepSpeed dict for composed config `cfg`. Blocks in `given` (a user file supplies them whole,
    user_config.merge) are not generated: the config values behind them may be the file's, not a group's."""
    micro, accum = cfg.train.batch_size, cfg.train.grad_accum
    ds: dict = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "gradient_clipping": cfg.train.grad_clip,
        "steps_per_print": 10**9,             # zerotune logs; DeepSpeed's own step prints are noise
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero_block(cfg, stats),
    }
    if is_client(cfg.optimizer.name):  # not normalize: it warns about an AdamW alias, as optimizer_block does
        if "optimizer" in given:
            raise ConfigError("optimizer", f"optimizer={cfg.optimizer.name} is built by zerotune and handed to "
                              "DeepSpeed, and the DeepSpeed file's optimizer block would replace it",
                              "remove the optimizer block from deepspeed.config_file, or choose its optimizer "
                              "(optimizer=adamw)")
        # the client optimizer may run on offloaded (host) partitions: DeepSpeed refuses that unless told
        ds["zero_force_ds_cpu_optimizer"] = False
    elif "optimizer" not in given:
        ds["optimizer"] = optimizer_block(cfg.optimizer)
    if not {"fp16", "bf16"} & set(given):
        ds.update(precision_blocks(cfg.precision))
    if "scheduler" not in given:
        lrs = text_encoders.group_lrs(cfg.model, cfg.optimizer.lr)  # one per parameter group
        sched = scheduler_block(cfg.scheduler, lrs, cfg.train.max_steps)
        if sched is not None:
            ds["scheduler"] = sched
    if cfg.offload.device == "nvme":
        ds["aio"] = dict(AIO_BLOCK)
    return ds


# A config meant for another machine can be checked for a card instead; "<overrides>" is replaced by the
# command line's own (UserConfig.attribute), so a value a file states is never re-typed.
PLAN_FOR_A_CARD = "zerotune plan <overrides> --gpu NAME"
DOCS = "https://www.deepspeed.ai/docs/config-json/"
# The JSON block each of DeepSpeed's config classes reads.
SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedZeroOffloadOptimizerConfig":
            "zero_optimization.offload_optimizer", "DeepSpeedZeroOffloadParamConfig":
            "zero_optimization.offload_param", "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16",
            "CompileConfig": "compile", "TPTrainingConfig": "tensor_parallel", "CommsLoggerConfig": "comms_logger",
            "HybridEngineConfig": "hybrid_engine", "WeightQuantConfig": "weight_quantization"}


def validate(ds: dict, platform: Platform, world_size: int = 1, client: dict | None = None) -> dict:
    """Return a normalised copy of `ds`, or raise ConfigError naming the key and the fix. `client`: the
    client optimizer the engine will be handed (builder.client_optimizer), checked against this ZeRO setup."""
    ds = copy.deepcopy(ds)
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}",
                          "zero_stage.stage=<0, 1, 2 or 3>, e.g. zero_stage.stage=3")
    if not platform.deepspeed_supported and stage >= 1:
        raise ConfigError("zero_stage", f"ZeRO stage {stage} needs DeepSpeed: {platform.deepspeed_reason}",
                          f"zero_stage=0 (plain accelerate here), or plan it for a CUDA card: {PLAN_FOR_A_CARD}")
    micro = Known.read(ds.get("train_micro_batch_size_per_gpu"), "micro batch", "train.batch_size")
    accum = Known.read(ds.get("gradient_accumulation_steps"), "accumulation", "train.grad_accum")
    total = ds.get("train_batch_size")
    given = None if total is None else Known.read(total, "train_batch_size", "train_batch_size", "the DeepSpeed dict")
    ds["train_batch_size"] = solve(micro, accum, given, world_size, micro, accum).total
    clip = ds.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError("gradient_clipping", f"must be >= 0 (0 disables clipping), got {clip!r}",
                          "train.grad_clip=1.0, or train.grad_clip=0 to disable clipping")
    bf16 = bool(ds.get("bf16", {}).get("enabled")) or bool(ds.get("bfloat16", {}).get("enabled"))
    fp16 = bool(ds.get("fp16", {}).get("enabled"))
    if bf16 and fp16:
        raise ConfigError("bf16.enabled", "bf16 and fp16 are both enabled", "enable one: precision=bf16 or "
                          "precision=fp16 (and remove the other block from deepspeed.config_file)")
    for name, on in (("bf16", bf16), ("fp16", fp16)):
        if on and not platform.supports(name):
            here = "precision=fp32" + ("" if name == "bf16" or not platform.bf16 else " or precision=bf16")
            raise ConfigError(f"{name}.enabled", f"this {platform.device_type} device cannot train in {name}",
                              f"{here}, or plan it for a card that can: {PLAN_FOR_A_CARD}")
    opt, param = zero.get("offload_optimizer"), zero.get("offload_param")
    opt_dev = (opt or {}).get("device", "none")
    param_dev = (param or {}).get("device", "none")
    if param_dev != "none" and stage < 3:
        raise ConfigError("zero_optimization.offload_param", f"parameter offload needs ZeRO stage 3, got stage "
                          f"{stage}", "zero_stage=3, or offload.params=false")
    if opt_dev != "none" and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer", "offload needs ZeRO stage 1 or more: stage 0 "
                          "has no partitioned optimizer to move", "zero_stage=2, or offload=none")
    if "nvme" in (opt_dev, param_dev):
        if stage < 3:
            raise ConfigError("offload", f"NVMe offload needs ZeRO stage 3: at stage {stage} DeepSpeed keeps "
                              "optimizer states in host memory and never writes the NVMe folder",
                              "zero_stage=3, or offload=cpu")
        for block_name, block in (("offload_optimizer", opt), ("offload_param", param)):
            if block and block.get("device") == "nvme":
                check_nvme_path(block.get("nvme_path"), f"zero_optimization.{block_name}.nvme_path "
                                            "(offload.path)")
    offloaded = opt_dev != "none"
    if "optimizer" in ds:
        opt = ds["optimizer"]
        name = normalize(opt.get("type", ""), key="optimizer.type")
        opt["type"] = DEEPSPEED_TYPES[name]
        check_supported(name, offloaded, key="optimizer.type", device_type=platform.device_type)
        check_params(name, opt.get("params") or {}, offloaded)
    if client is not None:
        if ds.get("zero_force_ds_cpu_optimizer") is not False:
            # accelerate would replace an offloaded client optimizer by DeepSpeed's CPU Adam (map_pytorch_optim_
            # to_deepspeed): another optimizer than the one planned and recorded
            raise ConfigError("zero_force_ds_cpu_optimizer", f"optimizer={client['name']} is handed to DeepSpeed as "
                              "a client optimizer, which this key set true would replace by CPU Adam",
                              "remove zero_force_ds_cpu_optimizer from deepspeed.config_file (zerotune sets it "
                              "false), or optimizer=adamw")
        check_client(client, opt_dev, platform.device_type)
    if "scheduler" in ds:
        _check_scheduler(ds["scheduler"])
    _deepspeed_accepts(ds)
    return ds


def _check_scheduler(block: Any) -> None:
    """DeepSpeed builds the scheduler only inside the engine, where a wrong name or parameter is a TypeError
    mid-start-up; the classes' own signatures answer it here."""
    from deepspeed.runtime import lr_schedules

    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind not in lr_schedules.VALID_LR_SCHEDULES:
        raise ConfigError("scheduler.type", f"DeepSpeed has no scheduler {kind!r}",
                          f"use one of: {', '.join(lr_schedules.VALID_LR_SCHEDULES)}")
    accepted = set(inspect.signature(getattr(lr_schedules, kind)).parameters) - {"self", "optimizer"}
    unknown = sorted(set(block.get("params") or {}) - accepted)
    if unknown:
        raise ConfigError(f"scheduler.params.{unknown[0]}", f"{kind} takes no parameter {unknown[0]!r}",
                          f"remove it; {kind} takes: {', '.join(sorted(accepted))}")


def _deepspeed_accepts(ds: dict) -> None:
    """Run DeepSpeed's own config parsing, so anything it would reject is reported here, in our words."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    probe = copy.deepcopy(ds)
    # DeepSpeedConfig takes the world size from torch.distributed; check batch arithmetic at world size 1.
    probe["train_batch_size"] = probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig(probe)
    except ValidationError as exc:
        raise _rejected_field(exc) from None
    except (DeepSpeedConfigError, AssertionError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("deepspeed", f"DeepSpeed rejects the config: {exc}",
                          f"correct the setting it names (see {DOCS})") from None


def _rejected_field(exc: Any) -> ConfigError:
    """A pydantic error of DeepSpeed's config classes, at the JSON key. A key DeepSpeed does not know is named
    with the nearest one it does, and its value is not repeated (it may be anything, a secret included)."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from pydantic import BaseModel

    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    key = ".".join([SECTIONS.get(exc.title, ""), *loc]).strip(".")
    if err.get("type") != "extra_forbidden":
        return ConfigError(key, f"DeepSpeed rejects it: {err.get('msg')} (got {err.get('input')!r})",
                           f"correct or remove that key (see {DOCS})")
    block = key.rpartition(".")[0] or "the top level"
    # the field names and aliases of the config class at the key's block
    models, todo = [], [DeepSpeedConfigModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            models.append(sub)
            todo.append(sub)
    model = next((m for m in models if m.__name__ == exc.title), None)
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        kinds = [field.annotation, *typing.get_args(field.annotation)] if field else []
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    names = [n for name, f in model.model_fields.items() for n in (name, f.alias) if n] if model else []
    guess = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    fix = f"rename it to {guess[0]}" if guess else f"delete it (see {DOCS})"
    return ConfigError(key, f"DeepSpeed rejects it: {err.get('msg')} ({block} has no key {loc[-1]!r})", fix)

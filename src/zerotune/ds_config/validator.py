"""Check a DeepSpeed dict before anything is built: the project's rules, then DeepSpeed's own classes."""

from __future__ import annotations

import copy
import difflib
from typing import Any

from zerotune.ds_config import offload as offload_mod
from zerotune.ds_config.batch import Known, solve
from zerotune.ds_config.optimizers import (
    DEEPSPEED_TYPES,
    check_client,
    check_params,
    check_supported,
    normalize,
)
from zerotune.errors import ConfigError
from zerotune.platform import Platform

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
                offload_mod.check_nvme_path(block.get("nvme_path"), f"zero_optimization.{block_name}.nvme_path "
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
    import inspect

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
    import typing

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

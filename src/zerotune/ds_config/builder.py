"""Compose the DeepSpeed config dict: fragments from the config groups, plus the derived values."""

from __future__ import annotations

from collections.abc import Collection

from zerotune.ds_config import offload as offload_mod
from zerotune.ds_config.optimizers import DEEPSPEED_TYPES, client_spec, is_client, normalize
from zerotune.ds_config.schedulers import scheduler_block
from zerotune.errors import ConfigError
from zerotune.models import ModelStats, text_encoders
from zerotune.schema import Config, DeepSpeed, Optimizer, Precision, as_dict


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
    zero.update(offload_mod.offload_blocks(cfg.offload, stage, stats.largest_param_numel))
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
        ds["aio"] = dict(offload_mod.AIO_BLOCK)
    return ds

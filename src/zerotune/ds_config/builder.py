"""Compose the DeepSpeed config dict: fragments from the config groups, plus the derived values."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.ds_config import offload as offload_mod
from zerotune.ds_config.optimizers import DEEPSPEED_TYPES, normalize
from zerotune.ds_config.schedulers import scheduler_block
from zerotune.errors import ConfigError


@dataclass(frozen=True)
class ModelStats:
    """What the builder needs to know about the model, measured on a meta-device copy."""

    num_params: int
    largest_param_numel: int


def optimizer_block(opt: Any, torch_adam: bool) -> dict:
    name = normalize(opt.name)
    params = {k: (list(v) if k == "betas" else v) for k, v in opt.items() if k != "name"}
    if name in ("adam", "adamw") and torch_adam:
        params["torch_adam"] = True
    return {"type": DEEPSPEED_TYPES[name], "params": params}


def precision_blocks(prec: Any) -> dict:
    if prec.name == "bf16":
        return {"bf16": {"enabled": True}}
    if prec.name == "fp16":
        return {"fp16": {"enabled": True, "initial_scale_power": int(prec.initial_scale_power),
                         "loss_scale_window": int(prec.loss_scale_window), "hysteresis": int(prec.hysteresis),
                         "min_loss_scale": float(prec.min_loss_scale)}}
    return {}


# DeepSpeed's own defaults, in elements.
DEFAULT_BUCKETS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000}


def bucket_size(ds: Any, key: str, stats: ModelStats) -> int:
    """A configured size, or for `auto` DeepSpeed's default capped at the parameter count (rounded up to 1M)."""
    value = ds[key]
    if value != "auto":
        return int(value)
    return min(DEFAULT_BUCKETS[key], -(-stats.num_params // 1_000_000) * 1_000_000)


def zero_block(cfg: Any, stats: ModelStats) -> dict:
    stage, ds = int(cfg.zero_stage.stage), cfg.deepspeed
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
                     "stage3_gather_16bit_weights_on_model_save": True})
    zero.update(offload_mod.offload_blocks(cfg.offload, stage, stats.largest_param_numel))
    return zero


def use_torch_adam(cfg: Any) -> bool:
    """torch's AdamW wherever DeepSpeed would otherwise JIT-build its fused kernel for no gain (no offload)."""
    setting = cfg.deepspeed.torch_adam
    if setting == "auto":
        return cfg.offload.device == "none"
    return bool(setting)


def build(cfg: Any, world_size: int, stats: ModelStats) -> dict:
    """The DeepSpeed dict for composed config `cfg`, before a hand-written JSON is merged on top."""
    micro, accum = int(cfg.train.batch_size), int(cfg.train.grad_accum)
    ds: dict = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "gradient_clipping": float(cfg.train.grad_clip),
        "steps_per_print": 10**9,             # zerotune logs; DeepSpeed's own step prints are noise
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero_block(cfg, stats),
        "optimizer": optimizer_block(cfg.optimizer, use_torch_adam(cfg)),
        **precision_blocks(cfg.precision),
    }
    sched = scheduler_block(cfg.scheduler, float(cfg.optimizer.lr), int(cfg.train.max_steps))
    if sched is not None:
        ds["scheduler"] = sched
    if cfg.offload.device == "nvme":
        ds["aio"] = dict(offload_mod.AIO_BLOCK)
    if cfg.deepspeed.config_file:
        ds = deep_merge(ds, load_json(str(cfg.deepspeed.config_file)))
    return ds


def deep_merge(base: dict, over: dict) -> dict:
    """`over` wins; nested dicts merge key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def load_json(path: str) -> dict:
    """Read a hand-written DeepSpeed JSON; a syntax error names its line and column."""
    key = "deepspeed.config_file"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"{file} does not exist", "point deepspeed.config_file at a DeepSpeed JSON file")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(key, f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                          "fix the JSON at that position") from None
    if not isinstance(data, dict):
        raise ConfigError(key, f"{file} must hold a JSON object, not {type(data).__name__}",
                          'wrap the settings in { ... }')
    # The reference's config.json nests the dict under "deepspeed_config"; accept both shapes.
    return data.get("deepspeed_config", data)

"""`"auto"` in a DeepSpeed file means "fill this from the run's settings", as accelerate and the HF Trainer
read it. zerotune fills every "auto" before validation, so nothing downstream (accelerate's own filler
included) ever sees one; an "auto" it has no value for is a config error naming the key.

Bucket sizes: accelerate derives them from `model.config.hidden_size`, which U-Nets lack. zerotune's
rule is DeepSpeed's own default capped at the model's parameter count (`deepspeed.*_bucket_size=auto`),
or the number set in `deepspeed.*`.
"""

from __future__ import annotations

from typing import Any

from zerotune.ds_config.batch import Batch
from zerotune.ds_config.builder import bucket_size
from zerotune.errors import ConfigError
from zerotune.models import ModelStats

AUTO = "auto"


def fill(ds: dict, cfg: Any, stats: ModelStats, batch: Batch, source: str) -> dict:
    """`ds` with every "auto" replaced; `source` names the file in errors."""
    ds = dict(ds)
    top = {"train_batch_size": batch.total, "train_micro_batch_size_per_gpu": batch.micro,
           "gradient_accumulation_steps": batch.accum, "gradient_clipping": cfg.train.grad_clip}
    for key, value in top.items():
        if ds.get(key) == AUTO:
            ds[key] = value
    for name in ("fp16", "bf16"):
        block = ds.get(name)
        if isinstance(block, dict) and block.get("enabled") == AUTO:
            ds[name] = {**block, "enabled": cfg.precision.name == name}
    if isinstance(ds.get("zero_optimization"), dict):
        ds["zero_optimization"] = _zero(ds["zero_optimization"], cfg, stats)
    if isinstance(ds.get("optimizer"), dict):
        ds["optimizer"] = _params(ds["optimizer"], _optimizer_values(cfg), "optimizer")
    if isinstance(ds.get("scheduler"), dict):
        ds["scheduler"] = _params(ds["scheduler"], _scheduler_values(cfg), "scheduler")
    _refuse_leftovers(ds, "", source)
    return ds


def _zero(zero: dict, cfg: Any, stats: ModelStats) -> dict:
    zero = dict(zero)
    knobs = cfg.deepspeed
    values = {"stage": cfg.zero_stage.stage,
              "stage3_param_persistence_threshold": int(knobs.stage3_param_persistence_threshold),
              "stage3_gather_16bit_weights_on_model_save":
                  bool(knobs.get("stage3_gather_16bit_weights_on_model_save", True))}
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        values[key] = bucket_size(knobs, key, stats)
    for key, value in values.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    return zero


def _optimizer_values(cfg: Any) -> dict:
    opt = cfg.optimizer
    values = {k: opt.get(k) for k in ("lr", "eps", "weight_decay") if opt.get(k) is not None}
    if opt.get("betas") is not None:
        values["betas"] = [float(b) for b in opt.betas]
    return values


def _scheduler_values(cfg: Any) -> dict:
    """Every scheduler parameter zerotune can derive from its scheduler group, optimizer lr and max_steps."""
    sched, lr, steps = cfg.scheduler, cfg.optimizer.lr, cfg.train.max_steps
    warmup = int(sched.get("warmup_steps", 0) or 0)
    half = max(steps // 2, 1)
    return {"warmup_min_lr": float(sched.get("min_lr", 0.0) or 0.0), "warmup_max_lr": lr,
            "warmup_num_steps": warmup, "total_num_steps": steps,
            "warmup_type": sched.get("warmup_type", "linear"),
            "warmup_min_ratio": float(sched.get("warmup_min_ratio", 0.0)),
            "cos_min_ratio": float(sched.get("cos_min_ratio", 0.0001)),
            "cycle_min_lr": lr / float(sched.get("div_factor", 25.0)), "cycle_max_lr": lr,
            "cycle_first_step_size": half, "cycle_second_step_size": max(steps - half, 1)}


def _params(block: dict, values: dict, name: str) -> dict:
    params = dict(block.get("params") or {})
    for key, value in params.items():
        if value == AUTO and key in values:
            params[key] = values[key]
    return {**block, "params": params}


def _refuse_leftovers(node: Any, path: str, source: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_leftovers(value, f"{path}.{key}" if path else key, source)
    elif node == AUTO:
        raise ConfigError(path, f"\"auto\" in {source}, and zerotune has no setting to fill it from",
                          f"write a value for {path} in {source}")

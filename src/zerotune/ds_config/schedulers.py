"""The DeepSpeed "scheduler" block for each scheduler option."""

from __future__ import annotations

from zerotune.errors import ConfigError
from zerotune.schema import Scheduler

TYPES = {"warmup": "WarmupLR", "warmup_decay": "WarmupDecayLR", "cosine": "WarmupCosineLR", "onecycle": "OneCycle"}
NAMES = (*TYPES, "constant")
# The parameters zerotune sets for each DeepSpeed scheduler (OneCycle: momentum cycling off, it would
# overwrite Adam's betas).
PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("total_num_steps", "warmup_num_steps", "warmup_min_ratio", "cos_min_ratio", "warmup_type"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_momentum", "decay_lr_rate"),
}


def derived_params(sched: Scheduler, lrs: list[float], max_steps: int) -> dict:
    """Every scheduler parameter zerotune derives from the scheduler group, the parameter groups' learning rates
    (`lrs`: optimizer.lr, then each trained text encoder's) and train.max_steps: for its own blocks, and for "auto"
    in a user's. DeepSpeed's WarmupLR and OneCycle set every group to their lr, or to the group's own entry of a
    list (`_format_param`); WarmupCosineLR scales each group's own lr."""
    half = max(max_steps // 2, 1)
    div = float(sched.div_factor)
    top: float | list[float] = lrs[0] if len(lrs) == 1 else list(lrs)
    low: float | list[float] = lrs[0] / div if len(lrs) == 1 else [lr / div for lr in lrs]
    return {"warmup_min_lr": float(sched.min_lr), "warmup_max_lr": top, "warmup_num_steps": int(sched.warmup_steps),
            "warmup_type": sched.warmup_type, "total_num_steps": max_steps,
            "warmup_min_ratio": float(sched.warmup_min_ratio), "cos_min_ratio": float(sched.cos_min_ratio),
            "cycle_min_lr": low, "cycle_max_lr": top, "cycle_first_step_size": half,
            "cycle_second_step_size": max(max_steps - half, 1), "cycle_momentum": False, "decay_lr_rate": 0.0}


def scheduler_block(sched: Scheduler, lrs: list[float], max_steps: int) -> dict | None:
    """DeepSpeed scheduler dict for `sched` (cfg.scheduler), `lrs` one per parameter group; None: constant lrs."""
    name = sched.name
    if name == "constant":
        return None
    if name in ("warmup", "warmup_decay", "cosine"):
        warmup = int(sched.warmup_steps)
        if warmup < 0 or (warmup == 0 and name != "warmup"):
            # DeepSpeed's schedulers refuse 0 warm-up steps; only plain warm-up has a 0-step equivalent.
            raise ConfigError("scheduler.warmup_steps", f"must be >= {0 if name == 'warmup' else 1} for "
                              f"scheduler={name}, got {warmup}", "scheduler.warmup_steps=100")
        if warmup == 0:
            return None  # WarmupLR with no warm-up is the optimizer's lr throughout
        if name != "warmup" and warmup >= max_steps:
            fix = f"scheduler.warmup_steps={max(max_steps // 10, 1)}" if max_steps > 1 else "scheduler=constant"
            raise ConfigError("scheduler.warmup_steps", f"{warmup} warm-up steps leave nothing to decay over "
                              f"train.max_steps={max_steps}", fix)
    if name in TYPES:
        kind = TYPES[name]
        values = derived_params(sched, lrs, max_steps)
        return {"type": kind, "params": {k: values[k] for k in PARAMS[kind]}}
    raise ConfigError("scheduler.name", f"unknown scheduler {name!r}", f"choose one of: {', '.join(NAMES)}")

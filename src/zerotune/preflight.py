"""Preflight: from a composed config to a checked run. Every bad configuration stops here, before any model exists."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotune import checkpoints, config_search, models
from zerotune.data import check_data
from zerotune.data.spec import DataSpec
from zerotune.ds_config import builder, validator
from zerotune.errors import ConfigError
from zerotune.loggers import check_logger
from zerotune.models import ModelStats, adapter
from zerotune.platform import Platform, detect
from zerotune.schema import launch_world_size
from zerotune.user_config import autofill, merge, resolve

log = logging.getLogger(__name__)

SEED_MAX = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)


@dataclass(frozen=True)
class CheckedRun:
    ds_config: dict           # validated; what DeepSpeed (or the plain path) will be given
    use_deepspeed: bool       # False: plain accelerate, stage 0 only
    model_stats: ModelStats
    input_shape: tuple[int, int, int]
    platform: Platform
    config_sources: dict = field(default_factory=dict)  # the user's files, where each value came from, config folders
    config_warnings: list[str] = field(default_factory=list)  # the DeepSpeed file's keys left out or translated
    resume: checkpoints.ResumeDecision | None = None     # the checkpoint to continue (checked), and how


def _use_deepspeed(cfg: Any, platform: Platform) -> bool:
    setting = cfg.deepspeed.enabled
    if setting == "auto":
        return platform.deepspeed_supported
    if setting is True and not platform.deepspeed_supported:
        raise ConfigError("deepspeed.enabled", f"DeepSpeed was asked for, but {platform.deepspeed_reason}",
                          "deepspeed.enabled=auto with zero_stage=0 (plain accelerate)")
    if setting is False and cfg.zero_stage.stage != 0:
        raise ConfigError("deepspeed.enabled", f"ZeRO stage {cfg.zero_stage.stage} needs DeepSpeed",
                          "deepspeed.enabled=auto, or zero_stage=0")
    if setting not in (True, False):
        raise ConfigError("deepspeed.enabled", f"must be auto, true or false, got {setting!r}",
                          "deepspeed.enabled=auto")
    return bool(setting)


def _check_train(cfg: Any) -> None:
    """What the DeepSpeed dict does not carry (its batch and clipping values are checked once, there)."""
    value = cfg.train.max_steps
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("train.max_steps", f"must be a positive integer, got {value!r}", "train.max_steps=1 or more")
    seed = cfg.train.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ConfigError("train.seed", f"must be an integer from 0 to 2**32 - 1 (numpy's seed range), "
                          f"got {seed!r}", "train.seed=0, or any integer in that range")
    if cfg.diffusion.prediction_type not in ("epsilon", "v_prediction"):
        raise ConfigError("diffusion.prediction_type", f"unknown {cfg.diffusion.prediction_type!r}",
                          "diffusion.prediction_type=epsilon or v_prediction")


def _check_inputs(cfg: Any) -> None:
    """The weights, data and logger a worker would open: what would fail there (after its start-up) fails here."""
    models.check_pretrained(cfg.model)
    check_data(DataSpec.from_config(cfg))
    check_logger(cfg.logger)


def _fit_default_warmup(cfg: Any, user) -> None:
    """A default warm-up longer than a short run (`train.max_steps=3`) is shortened to a tenth of the run;
    one typed on the command line or given by a file stays, and the scheduler check reports it."""
    steps, sched = cfg.train.max_steps, cfg.scheduler
    warmup = sched.get("warmup_steps")
    if sched.name not in ("warmup_decay", "cosine") or warmup is None or int(warmup) < steps:
        return
    if user.origin_of("scheduler.warmup_steps") != "default":
        return
    fitted = max(steps // 10, 1) if steps > 1 else 0
    log.warning("scheduler.warmup_steps=%s does not fit train.max_steps=%s: using %s", warmup, steps, fitted)
    cfg.scheduler.warmup_steps = fitted
    if fitted == 0:
        cfg.scheduler.name = "constant"  # one step leaves nothing to warm up or decay over


def preflight(cfg: Any, world_size: int | None = None, platform: Platform | None = None,
              overrides: list[str] | tuple = (), run_dir: str | Path | None = None,
              verified_resume: str | None = None) -> CheckedRun:
    """Check `cfg` and build its DeepSpeed dict. The user's DeepSpeed JSON and accelerate config are folded
    into `cfg` first, in place, so that it describes what will run; `overrides` (as typed on the command
    line) may not contradict them. `world_size`: None means `launch.num_processes x launch.nnodes`.
    With the job's `run_dir`, the checkpoint `resume` names is found, checked and judged too
    (`verified_resume`: a folder the job's parent already checksummed)."""
    platform = platform or detect()
    user = resolve(cfg, overrides, world_size)
    _fit_default_warmup(cfg, user)
    world_size = world_size or launch_world_size(cfg.launch)
    try:
        _check_train(cfg)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    shape = models.latent_shape(cfg.model, cfg.resolution.size)
    _check_inputs(cfg)
    use_ds = _use_deepspeed(cfg, platform)
    stats = models.model_stats(cfg.model, cfg.get("adapter"))
    try:
        ds = builder.build(cfg, world_size, stats, given=set(user.deepspeed or ()))
        if user.deepspeed is not None:
            ds = autofill.fill(merge.merge(ds, user.deepspeed), cfg, stats, user.batch, user.deepspeed_path)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    builder.choose_adam(ds, cfg)
    adapter.check_optimizer(cfg.get("adapter"), ds["optimizer"]["type"])
    try:
        ds = validator.validate(ds, platform, world_size)
    except ConfigError as exc:
        raise user.attribute(exc) from None  # named where the user set it: a file's key or zerotune's
    resume = None
    if run_dir is not None:
        path = checkpoints.resolve_resume(cfg.resume, cfg.checkpoint.dir, Path(run_dir), verified_resume)
        resume = checkpoints.decide_resume(path, checkpoints.current_meta(cfg, ds, use_ds, world_size), ds)
    return CheckedRun(ds_config=ds, use_deepspeed=use_ds, model_stats=stats, input_shape=shape, platform=platform,
                      config_sources={**user.summary(ds), "configs": config_search.current().describe()},
                      config_warnings=list(user.warnings), resume=resume)

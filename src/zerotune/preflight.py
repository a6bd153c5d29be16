"""Preflight: from a settled config (compose/settle.py) to a resolved run (zerotune/resolved.py). Every bad configuration stops
here, before any model exists."""

from __future__ import annotations

import logging
from pathlib import Path

from zerotune import checkpoints, config_search, models
from zerotune.compose.settle import Settled
from zerotune.data import check_data
from zerotune.data.spec import DataSpec
from zerotune.ds_config import builder, validator
from zerotune.errors import ConfigError
from zerotune.loggers import check_logger
from zerotune.models import adapter, param_groups, text_encoders
from zerotune.models.param_groups import ParamGroups
from zerotune.platform import Platform, detect
from zerotune.resolved import ResolvedRun
from zerotune.schema import Config
from zerotune.user_config import autofill, merge
from zerotune.validation import check_validation

log = logging.getLogger(__name__)

SEED_MAX = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)


def _use_deepspeed(cfg: Config, platform: Platform) -> bool:
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


def _check_train(cfg: Config) -> None:
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
    _check_loss_settings(cfg)
    text_encoders.check(cfg.model)


def _check_loss_settings(cfg: Config) -> None:
    """The loss settings SDXL recipes use (noise offset, Min-SNR-γ, a timestep range, zero terminal SNR)."""
    diff = cfg.diffusion
    offset = diff.noise_offset
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not 0 <= offset < 1:
        raise ConfigError("diffusion.noise_offset", f"must be a number from 0 (off) up to 1, got {offset!r}",
                          "diffusion.noise_offset=0.05 (SDXL recipes use 0.05 to 0.1), or "
                          "diffusion.noise_offset=0 to turn it off")
    gamma = diff.min_snr_gamma
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or gamma <= 0):
        raise ConfigError("diffusion.min_snr_gamma", f"must be a positive number or null, got {gamma!r}",
                          "diffusion.min_snr_gamma=5 (the paper's), or diffusion.min_snr_gamma=null to turn it off")
    steps = diff.num_train_timesteps
    window = diff.timestep_range
    if window is not None:
        if (len(window) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in window)
                or not 0 <= window[0] <= window[1] < steps):
            raise ConfigError("diffusion.timestep_range", f"must be [first, last] with 0 <= first <= last < "
                              f"{steps} (diffusion.num_train_timesteps), got {list(window)!r}",
                              f"diffusion.timestep_range=[0,{steps // 2 - 1}] (the less noisy half), or "
                              "diffusion.timestep_range=null for all of them")
    if diff.rescale_betas_zero_snr and diff.prediction_type != "v_prediction":
        raise ConfigError("diffusion.rescale_betas_zero_snr", "zero terminal SNR needs a v-prediction model: at "
                          "the last timestep the image is pure noise, so an epsilon model predicts nothing and "
                          "sampling divides by 0 (Lin et al. 2023, section 3.2)",
                          "model.prediction_type=v_prediction, or diffusion.rescale_betas_zero_snr=false")


def _check_inputs(cfg: Config, training: bool) -> None:
    """The weights, data and logger a worker would open: what would fail there (after its start-up) fails here."""
    models.check_pretrained(cfg.model)
    check_data(DataSpec.from_config(cfg), training)
    check_validation(cfg)
    check_logger(cfg.logger)


def check(settled: Settled, platform: Platform | None = None, run_dir: str | Path | None = None) -> ResolvedRun:
    """Check the settled config and build its DeepSpeed dict: every bad configuration stops here, before any
    model exists. With the job's `run_dir` (a job that will train), the checkpoint `resume` names is found, checked
    and judged too, and the data set is checked against the model."""
    cfg, user, world_size = settled.config, settled.user, settled.world_size
    platform = platform or detect()
    try:
        _check_train(cfg)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    shape = models.latent_shape(cfg.model, cfg.resolution.size)
    _check_inputs(cfg, training=run_dir is not None)
    use_ds = _use_deepspeed(cfg, platform)
    stats = models.model_stats(cfg.model, cfg.adapter)
    try:
        ds = builder.build(cfg, world_size, stats, given=set(user.deepspeed or ()))
        if user.deepspeed is not None:
            assert user.batch is not None and user.deepspeed_path is not None  # settled with the file
            ds = autofill.fill(merge.merge(ds, user.deepspeed), cfg, stats, user.batch, user.deepspeed_path)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    builder.choose_adam(ds, cfg)
    try:
        client = builder.client_optimizer(cfg.optimizer)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    adapter.check_optimizer(cfg.adapter, ds["optimizer"]["type"] if client is None else client["name"])
    try:
        ds = validator.validate(ds, platform, world_size, client)
    except ConfigError as exc:
        raise user.attribute(exc) from None  # named where the user set it: a file's key or zerotune's
    path = None if run_dir is None else checkpoints.resolve_resume(cfg.resume, cfg.checkpoint.dir, Path(run_dir))
    try:
        count = param_groups.count(cfg.deepspeed.param_groups, int(ds["zero_optimization"]["stage"]) if use_ds else 0,
                                   None if path is None else checkpoints.read_meta(path))
    except ConfigError as exc:
        raise user.attribute(exc) from None
    groups = ParamGroups.cut(stats.module_numels(), count)
    resume = None
    if path is not None:
        now = checkpoints.current_meta(cfg, ds, use_ds, world_size, client, groups)
        resume = checkpoints.decide_resume(path, now, ds)
    return ResolvedRun(config=cfg, ds_config=ds, use_deepspeed=use_ds, model_stats=stats, input_shape=shape,
                       platform=platform, world_size=world_size, client_optimizer=client, param_groups=groups,
                       config_sources={**user.summary(ds), "configs": config_search.current().describe()},
                       config_warnings=tuple(user.warnings), resume=resume)

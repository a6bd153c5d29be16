"""Where metrics go besides the run directory: nothing (logger=none) or W&B (logger=wandb)."""

from __future__ import annotations

import importlib.util

from zerotune.errors import ConfigError
from zerotune.loggers.base import NullLogger, RunLogger
from zerotune.schema import Config, Logger, as_dict


def make_logger(cfg: Config, run_dir: str, name: str, group: str | None, is_main: bool) -> RunLogger:
    """Only rank 0 talks to W&B; the other ranks get a logger that drops everything."""
    if cfg.logger.name == "none" or not is_main:
        return NullLogger()
    from zerotune.loggers.wandb_logger import WandbLogger

    lg = cfg.logger
    return WandbLogger(project=lg.project, run_dir=run_dir, config=as_dict(cfg),
                       name=name, group=group, mode=lg.mode, tags=list(lg.tags), entity=lg.entity)


def check_logger(logger_cfg: Logger) -> None:
    """For the job's parent: what would stop W&B at wandb.init in a worker, found in a second."""
    if logger_cfg.name != "wandb":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger", "logger=wandb needs the wandb package, which is not installed",
                          "pip install wandb (or zerotune[wandb]), or logger=none")
    from wandb.errors import AuthenticationError

    from zerotune.loggers.wandb_logger import LOCAL_MODES, api_key_found, known_modes

    mode = logger_cfg.mode
    if mode not in known_modes():
        raise ConfigError("logger.mode", f"wandb has no mode {mode!r} (it has {', '.join(known_modes())})",
                          "logger.mode=offline, or online after `wandb login`")
    if mode in LOCAL_MODES:
        return
    try:
        found = api_key_found()
    except AuthenticationError as exc:
        raise ConfigError("logger.mode", f"mode {mode} needs a valid W&B API key: {exc}",
                          "`wandb login`, or logger.mode=offline") from None
    if not found:
        raise ConfigError("logger.mode", f"mode {mode} logs to the W&B server and needs an API key; none is "
                          "configured (no WANDB_API_KEY, no .netrc entry for the W&B host, nothing in wandb's "
                          "settings), so wandb.init would fail in the worker", "`wandb login`, or logger.mode=offline")

"""Where metrics go besides the run directory: nothing (logger=none) or W&B (logger=wandb)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from zerotune.loggers.base import NullLogger, RunLogger


def make_logger(cfg: Any, run_dir: str, name: str, group: str | None, is_main: bool) -> RunLogger:
    """Only rank 0 talks to W&B; the other ranks get a logger that drops everything."""
    if cfg.logger.name == "none" or not is_main:
        return NullLogger()
    from zerotune.loggers.wandb_logger import WandbLogger

    lg = cfg.logger
    return WandbLogger(project=lg.project, run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True),
                       name=name, group=group, mode=lg.mode, tags=list(lg.tags), entity=lg.entity)

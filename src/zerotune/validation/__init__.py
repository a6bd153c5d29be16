"""Validation prompts sampled during training, at every ZeRO stage (the `validation` block of conf/config.yaml).

- prompts.py: the prompts, from the config and a prompt file, checked in preflight;
- weights.py: the U-Net as a pass samples with it (gathered under ZeRO-3, the EMA's weights swapped in);
- passes.py: when passes run, what they write and log, and how a failure is recorded.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from zerotune.errors import ConfigError
from zerotune.loggers.base import RunLogger
from zerotune.validation.prompts import ValidationPrompt, check_validation, enabled

if TYPE_CHECKING:
    from zerotune.training.trainer import Trainer
    from zerotune.validation.passes import Validator

__all__ = ["ValidationPrompt", "check_validation", "enabled", "make_validator"]

log = logging.getLogger(__name__)


def make_validator(trainer: Trainer, logger: RunLogger) -> tuple[Validator | None, dict | None]:
    """(the run's Validator or None, what stopped it from being made or None). Preflight has checked the prompts;
    a prompt file changed since, or components that fail to load, are recorded and the run goes on without
    validation, unless validation.strict."""
    cfg = trainer.cfg
    if not enabled(cfg):
        return None, None
    from zerotune.validation.passes import Validator

    try:
        prompts = check_validation(cfg)
        validator = Validator(cfg, prompts, trainer.run_dir, logger, trainer.accelerator.device, trainer.dtype,
                              trainer.rank, trainer.world)
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        if cfg.validation.strict:
            raise
        log.warning("validation is off for this run: %s", exc)
        return None, {"type": type(exc).__name__, "message": str(exc)[:500],
                      "key": getattr(exc, "key", None)}
    return validator, None

"""With hydra/launcher=slurm, the sweep's SLURM request is checked against the cluster before anything is
submitted (zerotune/slurm/precheck.py). Each refusal is a config error naming the `hydra.launcher.*` key, with a
value that passes as the fix.

It runs as a Hydra callback (conf/hydra/default.yaml): Hydra calls `on_multirun_start` once, after composing and
before its launcher submits the first job. Hydra turns an exception raised by a callback into a warning and carries
on, so the refusal ends the process itself (exit 2), as every config error does.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from zerotune.errors import ConfigError, exit_config_error
from zerotune.slurm.precheck import check_sweep, is_slurm


class SlurmCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_slurm(config.hydra.launcher):
            return
        try:
            check_sweep(config)
        except ConfigError as exc:
            exit_config_error(exc)

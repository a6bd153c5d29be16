"""With hydra/launcher=slurm, the sweep's SLURM request is checked against the cluster before anything is
submitted (zerotune/slurm/precheck.py). Each refusal is a config error naming the `hydra.launcher.*` key, with a
value that passes as the fix.

It runs as a Hydra callback (conf/hydra/default.yaml): Hydra calls `on_multirun_start` once, after composing and
before its launcher submits the first job. Hydra turns an exception raised by a callback into a warning and carries
on, so the refusal ends the process itself (exit 2), as every config error does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from zerotune.compose.settle import Settled, settle
from zerotune.errors import ConfigError, exit_config_error
from zerotune.slurm.precheck import check_sweep, is_slurm, request_of
from zerotune.slurm.request import Partition


class SlurmCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_slurm(config.hydra.launcher):
            return
        try:
            check_slurm_sweep(config)
        except ConfigError as exc:
            exit_config_error(exc)


def check_slurm_sweep(config: DictConfig, env: Mapping[str, str] | None = None) -> Partition:
    """The sweep's config (with its `hydra` node) as typed records for the check: its request, each job's
    overrides, and each job settled from them as Hydra's launcher composes it."""
    from hydra.core.global_hydra import GlobalHydra

    def settle_job(overrides: list[str]) -> Settled:
        job = GlobalHydra.instance().config_loader().load_sweep_config(config, overrides)
        with open_dict(job):
            job.pop("hydra", None)
        return settle(job, overrides, quiet=True)

    return check_sweep(request_of(config.hydra.launcher), sweep_jobs(config), settle_job, env)


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands the command line's."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]

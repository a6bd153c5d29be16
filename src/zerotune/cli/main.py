"""The `train.py` command: normalise argv, compose with Hydra, train, report."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from zerotune import CONF_DIR
from zerotune.cli.overrides import normalize_overrides, strip_local_rank, with_search_path
from zerotune.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.launch.spec import JobSpec

log = logging.getLogger("zerotune")


def _fail(exc: ConfigError) -> None:
    print(f"zerotune: config error at {exc}", file=sys.stderr)
    sys.exit(CONFIG_ERROR_EXIT)


def job_spec() -> JobSpec:
    from zerotune.loggers.wandb_logger import run_name_from_overrides

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    group = f"{Path(hc.sweep.dir).parent.name}/{Path(hc.sweep.dir).name}" if multirun else None
    overrides = [o.replace("'", "") for o in hc.overrides.task]  # zero_stage=2, as the user typed it
    return JobSpec(run_dir=hc.runtime.output_dir, run_name=run_name_from_overrides(overrides), group=group,
                   overrides=overrides)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from zerotune.launch.job import run_job
    from zerotune.training.run import print_result

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        summary = run_job(cfg, job_spec())
    except ConfigError as exc:
        if multirun:  # a sweep records the bad job (summary.json) and goes on
            log.error("config error at %s", exc)
            return
        _fail(exc)
    print_result(summary)
    if summary["status"] != "ok" and not multirun:
        sys.exit(1)


def main() -> None:
    # Hydra options (--cfg job, -m, --help) pass through untouched; only key=value overrides are rewritten.
    try:
        sys.argv[1:] = with_search_path(normalize_overrides(strip_local_rank(sys.argv[1:]), CONF_DIR), CONF_DIR)
    except ConfigError as exc:
        _fail(exc)
    _hydra_main()

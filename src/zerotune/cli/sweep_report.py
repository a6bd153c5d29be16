"""Write the sweep report when a Hydra sweep ends, and refresh it as each job ends.

Hydra skips `on_multirun_end` when a job's task function raised (its sweeper re-raises the first
failure), and a sweep stopped with Ctrl-C never gets there either; zerotune's task function records a
failure and returns, but the report is rebuilt in `on_job_end` too, so any sweep leaves a recent one.
A sweep of short jobs (a tune's trials, 2 to 4 s each) would spend a tenth of its time rebuilding it
(0.3 s a time here), so a job's end rebuilds it only where the last rebuild took at most REFRESH_SHARE of
the time since: after a 0.3 s rebuild, none for the next 15 s (at 5%, a tune of the small workload spent
4.7 s of 92 on it, its trials waiting). Longer jobs still refresh it each; a job
that raised, and the sweep's end, always do. A sweep stopped by Ctrl-C can leave its last seconds' jobs
out of summary.md (their summary.json are written): `zerotune report <sweep dir>` rebuilds it.
A report problem is logged, never raised: it must not fail or stop the sweep.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from zerotune.report.collect import RUNNING_WINDOW_S, NoRunsError

log = logging.getLogger(__name__)
REFRESH_SHARE = 0.02  # of a sweep's time, at most, spent rebuilding its report as jobs end


class SweepReportCallback(Callback):
    def __init__(self, refresh_each_job: bool = True) -> None:
        self.refresh_each_job = refresh_each_job
        self._next_refresh = 0.0  # time.monotonic() from which a job's end rebuilds the report again

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if not (self.refresh_each_job and _mode(config) == RunMode.MULTIRUN):
            return
        # A job that raised ends the sweep before on_multirun_end: its row must be in the report now.
        raised = getattr(job_return, "status", None) == JobStatus.FAILED
        started = time.monotonic()
        if started < self._next_refresh and not raised:
            return
        self.report(config, running_window_s=RUNNING_WINDOW_S, final=False)
        ended = time.monotonic()
        self._next_refresh = ended + (ended - started) / REFRESH_SHARE

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Every job has returned: a job folder without summary.json is missing, not running.
        self.report(config, running_window_s=0.0, final=True)

    def report(self, config: DictConfig, running_window_s: float, final: bool) -> None:
        """Build the report for `config.hydra.sweep.dir`; log, never raise, on failure."""
        if os.environ.get("RANK", "0") != "0":
            return  # under a multi-process launcher every rank runs Hydra; one writer is enough
        sweep_dir: Path | str = "?"
        try:
            from zerotune.report.build import build_report  # matplotlib loads only when a report is made

            sweep_dir = Path(str(config.hydra.sweep.dir))
            budget = OmegaConf.select(config, "report.budget_mib", default=None)
            metric = OmegaConf.select(config, "report.metric", default=None) or "gpu"
            where = OmegaConf.select(config, "report.where", default=None)
            where = OmegaConf.to_container(where) if where is not None else None
            report = build_report([sweep_dir], budget_mib=budget, metric=metric, where=where,  # type: ignore[arg-type]  # a DictConfig's container is a dict
                                  running_window_s=running_window_s)
        except (FileNotFoundError, NoRunsError) as exc:
            log.warning("sweep report skipped: %s", exc)
            return
        except Exception:  # noqa: BLE001 -- a broken report must never fail the sweep
            log.exception("sweep report for %s failed (the sweep itself is unaffected)", sweep_dir)
            return
        if not final:
            log.info("sweep report updated: %s", report.md_path)
            return
        log.info("sweep report: %s\n%s", report.md_path, report.table_md)
        if report.budget is not None:
            log.info("budget %.0f MiB (%s): %s", report.budget.budget_mib, report.budget.metric,
                     report.budget.reason)


def _mode(config: DictConfig) -> Any:
    try:
        return OmegaConf.select(config, "hydra.mode", default=None)
    except Exception:  # noqa: BLE001 -- an unreadable config just means "not a sweep we can report on"
        return None

"""zerotune's Hydra callbacks (conf/hydra/default.yaml): the run or sweep folder and a SLURM sweep's request checked
before anything is created or submitted, each refusal a config error naming the key with a value that works, and the
sweep report. Hydra turns a callback's exception into a warning and carries on, so a refusal ends the process itself
(exit 2), as every config error does."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from zerotune.config.compose.settle import Settled, settle
from zerotune.config.errors import ConfigError, exit_config_error
from zerotune.config.schema import Config
from zerotune.host.platform import file_system, nearest_existing, write_probe
from zerotune.job.slurm_cluster import (
    Cluster,
    JobTime,
    Partition,
    Request,
    check_request,
    check_time_to_checkpoint,
    fitting_nodes,
    read_cluster,
)
from zerotune.plan import gpus
from zerotune.report.collect import RUNNING_WINDOW_S, NoRunsError

# What a run's own records need (config, logs, metrics, summary); checkpoints check their own room.
MIN_FREE_BYTES = 16 * 2**20


class RunDirCheck(Callback):
    """`hydra.run.dir` (`hydra.sweep.dir`) checked after composing and before Hydra's own mkdir: a path through a
    file, a folder this user cannot write, or a disk without room is refused."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit("hydra.sweep.dir", config.hydra.sweep.dir)


def _check_or_exit(key: str, folder: str) -> None:
    try:
        check_run_dir(key, folder)
    except ConfigError as exc:
        exit_config_error(exc)


def check_run_dir(key: str, folder: str) -> None:
    """A ConfigError naming `key` unless `folder` exists as a writable folder, or can be created as one, on a
    disk with MIN_FREE_BYTES free."""
    problem = problem_with(Path(folder))
    if problem:
        raise ConfigError(key, problem, _fix(key, Path(folder)))


def problem_with(folder: Path) -> str | None:
    existing = nearest_existing(folder)
    if not existing.is_dir():
        if existing == folder.absolute():
            return f"{folder} is an existing file, not a folder"
        return f"{existing} is a file, so {folder} cannot be created under it"
    exc = write_probe(existing)
    if exc is not None:
        return f"no file can be created in {existing}: {exc.strerror} ({existing} is on {file_system(existing)})"
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        return f"the disk holding {existing} has {free / 2**20:.1f} MiB free; a run needs {MIN_FREE_BYTES // 2**20} MiB"
    return None


def _fix(key: str, folder: Path) -> str:
    """The first of a few nearby folders that passes the same check, as the override to type."""
    absolute = folder.absolute()
    home = "multirun" if key == "hydra.sweep.dir" else "outputs"  # where Hydra puts them by default
    candidates = [absolute.with_name(absolute.name + "-run"), Path.cwd() / home / absolute.name,
                  Path(tempfile.gettempdir()) / "zerotune" / absolute.name]
    for candidate in candidates:
        if problem_with(candidate) is None:
            return f"{key}={candidate}"
    return f"{key}=<a folder you can write, on a disk with room>"


log = logging.getLogger(__name__)
REFRESH_SHARE = 0.02  # of a sweep's time, at most, spent rebuilding its report as jobs end


class SweepReportCallback(Callback):
    """The sweep report, written when a sweep ends and refreshed as jobs end (Hydra skips `on_multirun_end` after a
    job raised or Ctrl-C). A job's end rebuilds it only where the last rebuild took at most REFRESH_SHARE of the time
    since (at 5%, a tune of the small workload spent 4.7 s of 92 on it, its trials waiting); a job that raised, and
    the sweep's end, always do. A report problem is logged, never raised: it must not fail or stop the sweep."""

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


log = logging.getLogger("zerotune")


def is_slurm(launcher: Mapping[str, Any]) -> bool:
    return str(launcher.get("_target_", "")).endswith("SlurmLauncher")


def request_of(launcher: Mapping[str, Any]) -> Request:
    """The launcher's settings (Hydra's `hydra.launcher` node) sbatch matches against the cluster; a count below 1
    is refused here."""
    # A null setting is Request's default (None: not asked).
    given: dict[str, Any] = {f.name: launcher.get(f.name) for f in fields(Request) if launcher.get(f.name) is not None}
    req = Request(**given)
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "tasks_per_node", "mem_gb", "timeout_min"):
        value = getattr(req, key)
        if value is not None and value < (0 if key == "gpus_per_node" else 1):
            raise ConfigError(f"hydra.launcher.{key}", f"must be at least 1, got {value}",
                              f"hydra.launcher.{key}={1 if key in ('nodes', 'tasks_per_node', 'timeout_min') else 'null'}")
    return req


def check_sweep(req: Request, jobs: list[list[str]], settle_job: Callable[[list[str]], Settled],
                env: Mapping[str, str] | None = None) -> Partition:
    """Check the sweep's request against the cluster; the partition the jobs go to, or a ConfigError. `jobs`:
    each job's overrides; `settle_job`: a job's config from its overrides, as its launcher composes it."""
    cluster = read_cluster(env)
    partition = check_request(cluster, req)
    check_time_to_checkpoint(partition, req, job_times(jobs, settle_job, cluster, partition, req))
    return partition


def job_times(jobs: list[list[str]], settle_job: Callable[[list[str]], Settled], cluster: Cluster,
              partition: Partition, req: Request) -> list[JobTime]:
    """What each job needs before its first checkpoint. A time per step is known only for jobs with GPUs of a
    known card, so only then are the jobs composed (and planned)."""
    if not req.gpus_per_node:
        return [JobTime("", None, False, None)]
    card = gres_card(fitting_nodes(cluster, partition.name, req))
    times = []
    for overrides in jobs:
        label = " ".join(overrides)
        try:
            settled = settle_job(overrides)
        except ConfigError:  # the job refuses itself, naming the key, when it runs
            times.append(JobTime(label, None, False, None))
            continue
        cfg = settled.config
        steps, on_signal = steps_to_first_checkpoint(cfg), cfg.checkpoint.on_signal
        job_card = card or (gpus.CATALOG.get(cfg.plan.gpu.lower()) if cfg.plan.gpu else None)
        floor = None
        if steps and not on_signal and job_card is not None:
            floor = step_floor(settled, job_card, req)
        times.append(JobTime(label, steps, on_signal, floor))
    return times


def steps_to_first_checkpoint(cfg: Config) -> int | None:
    """Optimizer steps to the job's first scheduled save; None where none is scheduled, or where they are not
    known (a resumed job starts part way; a plan.only job does not train)."""
    if cfg.resume.path is not None or cfg.plan.only:
        return None
    every, last = cfg.checkpoint.every_n_steps or 0, cfg.train.max_steps
    if every > 0 and (last is None or every <= last):
        return every
    return last if cfg.checkpoint.final and last else None


# gres types as clusters name them (a100, nvidia_h100_80gb_hbm3, rtx_4090) -> the catalog's card. A token must
# match whole (an "l40" is not an "l4"); an unknown type gives no time floor rather than a wrong one.
_GRES_CARDS = {"h200": "h200", "h100": "h100", "a100": "a100-80", "l40s": "l40s", "l4": "l4", "4090": "rtx4090",
               "rtx4090": "rtx4090", "3090": "rtx3090", "rtx3090": "rtx3090"}


def gres_card(nodes: list) -> gpus.GPU | None:
    """The fastest card the job could get, among the nodes it fits on; None if any of them names no known type
    (the time per step is then a bound only for the card plan.gpu names)."""
    cards = []
    for node in nodes:
        found = [_GRES_CARDS[t] for gres_type in node.gpu_types for t in re.split(r"[^a-z0-9]+", gres_type.lower())
                 if t in _GRES_CARDS]
        if not node.gpu_types or len(found) != len(node.gpu_types):
            return None
        cards += [gpus.CATALOG[c] for c in found]
    return max(cards, key=lambda g: (g.bf16_tflops, g.host_link_gbps), default=None)


def step_floor(settled: Settled, card: gpus.GPU, req: Request) -> float | None:
    """The planner's lower bound on one optimizer step of this job on `card`, from the terms that do not depend
    on this machine (the card's compute and host link; not the CPU optimizer, timed here). None where the
    planner cannot tell (it fails on this job: the job reports why itself)."""
    from zerotune.host.platform import ANY_CUDA_GPU
    from zerotune.plan.predict import predict
    from zerotune.plan.resolve import check

    per_node = req.gpus_per_node or 0
    launch = replace(settled.config.launch, num_processes=per_node, nnodes=req.nodes)
    on_cluster = replace(settled, config=replace(settled.config, launch=launch), world_size=per_node * launch.nnodes)
    try:
        resolved = check(on_cluster, ANY_CUDA_GPU)
        terms = predict(resolved, card).time_terms
    except Exception as exc:  # noqa: BLE001 (no floor is no refusal)
        log.debug("no time floor for %s: %s", settled.config.launch, exc)
        return None
    known = [t.seconds for t in terms if t.term in ("compute", "pcie") and t.seconds]
    return max(known, default=None)


class SlurmCheck(Callback):
    """The sweep's SLURM request (partition, nodes, GPUs, CPUs and memory per node, time limit) checked against the
    cluster (job/slurm_cluster.py) before the launcher submits the first job."""

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

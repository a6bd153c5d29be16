"""The `train.py` command: normalise argv, compose with Hydra, train, report."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zerotune.config import search as config_search
from zerotune.config.compose import as_config_error, check_command_line, check_resolves, is_multirun
from zerotune.config.compose.overrides import as_typed, normalize_overrides, strip_local_rank, take_config_dir
from zerotune.config.compose.settle import Settled, settle, to_config
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError, exit_config_error
from zerotune.host import process
from zerotune.host.process import exit_now
from zerotune.host.timing import process_start_time
from zerotune.job.elastic import check_launch
from zerotune.job.slurm import (
    ends_the_step,
    job_settings,
    job_start_time,
    record_lost_attempts,
    requeue_if_preempted,
)
from zerotune.rundir import JobSpec, RunDir, run_name
from zerotune.rundir.summary import SUCCEEDED, RunSummary, Status, print_result
from zerotune.train import distributed

log = logging.getLogger("zerotune")


def job_spec() -> JobSpec:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    group = f"{Path(hc.sweep.dir).parent.name}/{Path(hc.sweep.dir).name}" if multirun else None
    # zero_stage=2, as the user typed it; unresolved: an interpolation typed there is checked in the task
    overrides = as_typed(OmegaConf.to_container(hc.overrides.task, resolve=False))  # type: ignore[arg-type]  # a ListConfig's container is a list
    return JobSpec(run_dir=hc.runtime.output_dir, run_name=run_name(overrides), group=group, overrides=overrides)


# The packaged configs; the user's folder is searched before them (hydra_plugins/zerotune_user_configs).
@hydra.main(config_path=f"pkg://{config_search.PACKAGED_CONF}", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    _task_started()
    process.route_library_logs()  # before the job's imports: libraries' chatter to main.log, not the console
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    spec = job_spec()
    try:
        check_resolves(cfg, spec.overrides)  # an interpolation typed on the command line, e.g. ${oc.env:...}
        settled = settle_job(cfg, spec)
        # Under torchrun / `accelerate launch` / `deepspeed` this process is one rank already: it trains.
        # Otherwise it is the job's parent, which starts the workers and records what they did.
        summary = _train_here(settled, spec) if distributed.launched_externally() else _run_job(settled, spec)
    except ConfigError as exc:
        if multirun:  # a sweep records the bad job (summary.json) and goes on
            log.error("config error at %s", exc)
            return
        exit_config_error(exc)
    if distributed.rank() == 0:  # under an external launcher the other ranks' summaries are partial
        # Under an external launcher this process is one rank, not the command the person typed.
        command_s = None if distributed.launched_externally() else time.time() - process_start_time()
        print_result(summary, command_s=command_s)
    if summary.status == Status.INTERRUPTED:
        requeue_if_preempted(summary)  # under submitit, on its signal: now that the workers have saved
        sys.exit(_interrupted_exit(summary))  # a sweep stops too: the signal was meant for all of it
    if multirun and ends_the_step(summary, settled.config.launch.node_rank):
        sys.exit(1)
    if summary.status not in SUCCEEDED and not multirun:
        # A config problem found in a worker (e.g. a refused resume) is still a config problem.
        sys.exit(CONFIG_ERROR_EXIT if summary.error_type == "ConfigError" else 1)


# Imported when called, not at the top: they bring torch, DeepSpeed and diffusers (seconds), which `--help`,
# `--cfg job` and a config error never need; and the job's parent never imports the trainer (its evaluation
# brings scikit-learn): its workers do.
def _run_job(settled: Settled, spec: JobSpec) -> RunSummary:
    from zerotune.job.parent import run_job

    return run_job(settled, spec)


def _train_here(settled: Settled, spec: JobSpec) -> RunSummary:
    from zerotune.train.run import train_launched_externally

    return train_launched_externally(settled, spec)


def settle_job(cfg: DictConfig, spec: JobSpec) -> Settled:
    """The job's config as it will run, settled here, before anything else: the user's files and, in a SLURM job
    started by hydra/launcher=slurm, its nodes folded in; the launch block checked. Past this function the job
    is given the frozen config. The run dir's earlier records are moved aside first (by node 0's first rank);
    a refusal is then recorded in summary.json (and config.yaml, as composed) and raised."""
    composed = to_config(cfg)
    launched_here = not distributed.launched_externally()
    # An external launcher's ranks each settle (quietly but the first) and take its world size.
    surroundings = job_settings(composed, spec.run_dir) if launched_here else {}
    try:
        settled = settle(cfg, spec.overrides, None if launched_here else distributed.world_size(),
                         settings=surroundings, quiet=distributed.rank() != 0)
        if launched_here:
            check_launch(settled.config.launch)
    except ConfigError:
        if _archive_previous_attempt(surroundings.get("launch.node_rank", composed.launch.node_rank), spec):
            from zerotune.job.records import refusal_recorded  # brings torch: only a refusal needs it

            run_dir = RunDir(spec.run_dir)
            run_dir.write_config(composed)
            with refusal_recorded(composed, spec, run_dir):
                raise
        raise
    _archive_previous_attempt(settled.config.launch.node_rank, spec)
    return settled


def _archive_previous_attempt(node_rank: int, spec: JobSpec) -> bool:
    """A rerun into this folder never overwrites its records. Only node 0 moves them, and only what was there
    before this job began: over a shared file system the other nodes write here too. The kernel's start of this
    process, not a clock read at import: under submitit this function arrives pickled by value, its globals as
    they were in the submitting process (a requeued attempt's would move nothing). Whether this process is the
    job's writer (node 0's first rank)."""
    if distributed.rank() != 0 or node_rank != 0:
        return False
    run_dir = RunDir(spec.run_dir)
    run_dir.archive_previous_attempt(started=process_start_time())
    record_lost_attempts(spec.run_dir, os.environ)  # in a requeued SLURM job: one record per attempt
    return True


def _interrupted_exit(summary: RunSummary) -> int:
    """128 + the signal's number, as a shell reports a process a signal ended (130 for Ctrl-C)."""
    name = (summary.interrupted or {}).get("signal")
    return 128 + int(getattr(signal, name, signal.SIGTERM)) if isinstance(name, str) else 128 + signal.SIGTERM


def agree_across_ranks(args: list[str]) -> list[str]:
    """Under torchrun / `accelerate launch` / `deepspeed`, every rank runs this CLI: the ranks join the default
    process group and take rank 0's clock, so `${now:...}` in hydra.run.dir (and hydra.sweep.dir) names ONE folder
    on every rank. The others write nothing of Hydra's there (hydra.output_subdir=null, hydra/job_logging=stdout);
    only rank 0 writes the run's files and talks to W&B."""
    if not distributed.launched_externally() or distributed.world_size() == 1 or _hydra_option_only(args):
        started = job_start_time(os.environ)  # `srun` started this process on each node of a SLURM job
        if started is not None and not _hydra_option_only(args):
            pin_hydra_clock(started)
        return args
    distributed.init_process_group()
    pin_hydra_clock(distributed.broadcast_object(datetime.now()))
    if distributed.rank() == 0:
        return args
    extra = ["hydra.output_subdir=null"]
    if not any(a.lstrip("+~").startswith("hydra/job_logging=") for a in args):
        extra.append("hydra/job_logging=stdout")
    return [*args, *extra]


def _hydra_option_only(args: list[str]) -> bool:
    return any(a in ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i") for a in args)


def pin_hydra_clock(moment: datetime) -> None:
    """Make Hydra's `${now:...}` resolver read `moment` (it calls hydra.core.utils.datetime.now)."""
    import hydra.core.utils as hydra_utils

    class _Pinned(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 (datetime's signature)
            return moment

    hydra_utils.datetime = _Pinned  # type: ignore[misc]  # Hydra's module patched: its resolver reads this name


def main() -> None:
    """train.py's entry point. It ends through exit_now: the status is the one Hydra and zerotune chose, without
    the interpreter's second or so of teardown (see zerotune/host/process.py)."""
    try:
        _main()
    except SystemExit as exc:
        exit_now(exc.code)
    exit_now(0)


def _main() -> None:
    # Hydra options (--cfg job, -m, --help) pass through untouched; only key=value overrides are rewritten.
    try:
        args, config_dir = take_config_dir(strip_local_rank(sys.argv[1:]))
        search = config_search.choose_and_warn(config_dir)
        args = agree_across_ranks(args)
        sys.argv[1:] = normalize_overrides(args, search)
        check_command_line(sys.argv[1:])  # added keys; and for a sweep, every job's types and keys, before Hydra starts
        if is_multirun(sys.argv[1:]):
            # A sweep's jobs act on a stop signal where they run (each job process holds its own); this process
            # only submits or runs them, and ends on one as it always did.
            process.release()
            _hydra_main()
            return
        with _composition_errors_raised():
            _hydra_main()
    except (HydraException, OmegaConfBaseException) as exc:
        exit_config_error(as_config_error(exc, sys.argv[1:]))
    except ConfigError as exc:
        exit_config_error(exc)


_FULL_ERROR = "HYDRA_FULL_ERROR"
_UNSET = object()
_full_error_before: object = _UNSET  # the user's own value while zerotune's "1" stands in for it


@contextlib.contextmanager
def _composition_errors_raised():
    """Hydra prints a composition error in its own words and exits 1. With HYDRA_FULL_ERROR=1 it raises it
    instead, and _main reports it as a config error (exit 2, the key and the fix), so a single run is composed
    once rather than once more beforehand. Hydra reads only "1" as set, so any other value the user has
    (HYDRA_FULL_ERROR=0 in a shell profile) is stood in for, then put back. The task function puts it back at
    once (`_task_started`): what fails in the job itself is reported as Hydra reports it, and no worker
    inherits zerotune's value."""
    global _full_error_before
    if os.environ.get(_FULL_ERROR) != "1":
        _full_error_before = os.environ.get(_FULL_ERROR)
        os.environ[_FULL_ERROR] = "1"
    try:
        yield
    finally:
        _task_started()


def _task_started() -> None:
    global _full_error_before
    if _full_error_before is _UNSET:
        return
    if _full_error_before is None:
        os.environ.pop(_FULL_ERROR, None)
    elif isinstance(_full_error_before, str):
        os.environ[_FULL_ERROR] = _full_error_before
    _full_error_before = _UNSET

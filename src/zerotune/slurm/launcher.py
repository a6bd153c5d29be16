"""What the sweep's SLURM launcher (`hydra/launcher=zerotune_slurm`, src/hydra_plugins/zerotune_slurm) changes in
hydra-submitit-launcher's: the task srun starts on each node, the batch script's shell, and how each job's end is
awaited and recorded. The plugin's class only calls these; submitit is imported only here, when they run."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

from hydra.core.utils import JobReturn, JobStatus

from zerotune.slurm import job_end

log = logging.getLogger(__name__)


def task_command(executor: Any) -> str:
    """What srun runs on each node: submitit's task, its stop signals held from its first line."""
    return " ".join([executor.python, "-u -m zerotune.slurm.task", shlex.quote(str(executor.folder))])


def batch_script(executor: Any, command: str, uid: str) -> str:  # noqa: ARG001 (submitit's signature)
    """submitit's sbatch script, whose shell ignores the pre-emption signal: SLURM signals the shell too when
    asked to (`scancel --full`), and the shell, which only waits on srun, would end the job FAILED of it. Its
    last line before srun marks the attempt in the job's stderr, where srun says which task ended first."""
    from submitit.slurm.slurm import SlurmJobEnvironment, _make_sbatch_string

    setup = [f"trap '' {SlurmJobEnvironment.USR_SIG}", *(executor.parameters.get("setup") or []),
             f'echo "{job_end.ATTEMPT_LINE}" >&2']
    return _make_sbatch_string(command=command, folder=executor.folder, **{**executor.parameters, "setup": setup})


def submitted(launch: Callable[[], object]) -> list:
    """The jobs the plugin's own submission (its executor, parameters and logging) submits, kept and not waited
    on: `launch` is its `launch`, whose last line waits on every job; here it waits on none."""
    import submitit
    from submitit.slurm.slurm import SlurmExecutor

    captured: list = []
    real_map_array = submitit.AutoExecutor.map_array

    def map_array(executor: Any, fn: Any, *iterables: Any) -> list:
        captured.extend(real_map_array(executor, fn, *iterables))
        return []  # the plugin then waits on no job: `outcome` does, one by one

    with patch.object(submitit.AutoExecutor, "map_array", map_array), \
            patch.object(SlurmExecutor, "_submitit_command_str", property(task_command)), \
            patch.object(SlurmExecutor, "_make_submission_file_text", batch_script):
        launch()
    return captured


def outcome(job: Any, overrides: list[str], run_dir_of: Callable[[], Path]) -> JobReturn:
    """The job's result once it wrote one; else (cancelled, killed, its node lost) a summary.json in its run
    folder (`run_dir_of`: as Hydra names it inside the job) with SLURM's state and the node whose task ended first
    as srun saw it, returned as COMPLETED so that the sweep goes on to the next job."""
    state = job_end.wait_for_end(job)
    failure = ""
    if state == "COMPLETED":
        try:
            return job.results()[0]
        except Exception as exc:  # submitit's FailedJobError: the task raised past Hydra (its traceback)
            failure = str(exc).strip().splitlines()[-1][:500]
    run_dir = run_dir_of()
    stderr, restarts = job_end.srun_output(job), job_end.job_restarts(str(job.job_id))
    # Every task's own error, where they raised; else srun's word on the task that ended first.
    ended_first = None if failure else job_end.first_task_end(stderr, restarts)
    summary = job_end.record_lost_job(run_dir, str(job.job_id), None if state == "COMPLETED" else state, overrides,
                                      failure or (stderr.splitlines() or [""])[-1], restarts=restarts,
                                      ended_first=ended_first)
    # COMPLETED, as zerotune's own task returns for a job that failed in a sweep: recorded, and the sweep goes on.
    return JobReturn(overrides=overrides, working_dir=str(run_dir), status=JobStatus.COMPLETED,
                     _return_value=summary)

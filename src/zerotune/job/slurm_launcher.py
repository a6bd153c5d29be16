"""The sweep's SLURM launcher's logic (hydra/launcher=zerotune_slurm; its plugin only calls this, and submitit is
imported only here): how a job ended, from squeue and scontrol (without accounting there is no sacct, and submitit
waits forever on a lost job), which node ended first (srun's lines in the job's stderr), and a lost job's record."""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

import yaml
from hydra.core.utils import JobReturn, JobStatus

from zerotune.config.errors import ConfigError
from zerotune.config.files import write_text_atomic
from zerotune.job.slurm_cluster import SCONTROL_TIMEOUT_S, parse_int, scontrol, show_job
from zerotune.rundir import RunDir
from zerotune.rundir.summary import FINAL, RunSummary, Status

log = logging.getLogger(__name__)

# squeue's states of a job not over yet (a requeued job is PENDING again).
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
# What summary.json says of a job SLURM ended in these states without a result from it.
STATUS_OF_STATE = {"CANCELLED": Status.CANCELLED, "TIMEOUT": Status.TIMEOUT, "OUT_OF_MEMORY": Status.OOM,
                   "DEADLINE": Status.TIMEOUT}
# A summary the job itself wrote with a FINAL status keeps it: it is the more precise account.
# States in which SLURM itself ended the job's tasks: which of them ended first says nothing of a node.
ENDED_BY_SLURM = {"CANCELLED", "TIMEOUT", "DEADLINE", "PREEMPTED"}


def job_state(job_id: str) -> str | None:
    """SLURM's state of `job_id` ("123" or an array task "123_4"): squeue's while queued or running, then
    scontrol's final one; None where neither knows the job (never submitted, or long gone)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                timeout=SCONTROL_TIMEOUT_S)
        if queued.returncode == 0 and queued.stdout.strip():
            return queued.stdout.split()[0].upper()
    return (show_job(job_id) or {}).get("JobState", "").upper() or None


def wait_for_end(job, state_of: Callable[[str], str | None] = job_state, poll_s: float = 2.0,
                 grace_s: float = 20.0) -> str | None:
    """Wait until the job's results are written, or it has left SLURM's queue: then its last state (None where
    SLURM no longer knows it). `grace_s`: how long after leaving the queue its result files may still appear
    (a shared file system shows them late)."""
    left_at = None
    while True:
        if all(job.task(i).paths.result_pickle.exists() for i in range(job.num_tasks)):  # results, or errors
            return "COMPLETED"
        state = state_of(job.job_id)
        if state in ACTIVE:
            left_at = None
        elif left_at is None:
            left_at = time.monotonic()
        elif time.monotonic() - left_at > grace_s:
            return state
        time.sleep(poll_s)


def job_restarts(job_id: str) -> int | None:
    """How many times SLURM requeued the job (scontrol's Restarts), or None where it no longer knows the job."""
    return parse_int((show_job(job_id) or {}).get("Restarts"))


def record_lost_job(run_dir: Path, job_id: str, state: str | None, overrides: list[str], detail: str,
                    restarts: int | None = None, ended_first: TaskEnd | None = None) -> RunSummary:
    """summary.json for a job SLURM ended without a result: its last attempt's own summary, if any, with SLURM's
    account added; its status from SLURM's state unless the job recorded a final one. `restarts`: SLURM's requeue
    count. `ended_first` (`first_task_end`): the error names its node, unless SLURM ended the job itself or the
    job's own record names a failed node."""
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = RunSummary.read_if_whole(run_dir)
    if summary is not None and not _last_attempts(summary, job_id, restarts):
        RunDir(run_dir, is_writer=False).archive_previous_attempt()
        summary = None
    if summary is None or not summary.as_dict():
        summary = RunSummary(run_dir=str(run_dir))
    summary.previous_attempts = RunDir(run_dir, is_writer=False).previous_attempts()
    shown = state or "unknown to SLURM"
    summary.slurm = {**(summary.slurm or {"job_id": job_id}), "state": shown}
    if restarts is not None:
        summary.slurm["restart_count"] = restarts
    first = None
    if ended_first is not None and state not in ENDED_BY_SLURM:
        first = ended_first.record(node_ranks(ended_first.node, summary.slurm.get("nodelist"), job_id))
        if _names_its_node(summary.error, first):
            first = None
    said = (f"SLURM job {job_id} ended without a result (state {shown})"
            + (f": {first['message']}" if first else f": {detail}" if detail else ""))
    node = {k: v for k, v in (first or {}).items() if k != "message"}
    if summary.status not in FINAL:
        job_status = summary.status if summary.status is not None else summary.extra.pop("status", None)
        summary.error = {"type": "slurm", "message": said, **node, "job_status": job_status,
                         "job_error": summary.error}
        summary.status = STATUS_OF_STATE.get(str(state), Status.FAILED)
    elif first is not None and summary.error is not None:  # the job's own failure, without the node that caused it
        summary.error = {"type": "slurm", "message": said, **node, "job_error": summary.error}
    elif summary.error is None and "error" not in summary.nulls:
        summary.error = {"type": "slurm", "message": said, **node}
    summary.write(run_dir)
    hydra_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not hydra_overrides.exists():  # the report reads a job's parameters there (Hydra writes it when the job starts)
        hydra_overrides.parent.mkdir(exist_ok=True)
        write_text_atomic(hydra_overrides, yaml.safe_dump(list(overrides)))
    log.error("%s: %s", run_dir, said)
    return summary


def _names_its_node(error: dict | None, first: dict) -> bool:
    """Whether the job's own error names the node that failed first (node 0 read every node's record), other than
    one that recorded nothing: srun's account is the better one for a node killed whole."""
    if not error or not error.get("failed_node"):
        return False
    silent = set(error.get("silent_nodes") or [])
    return not ({first.get("failed_node_rank"), *first.get("failed_node_ranks", [])} & silent)


def _last_attempts(summary: RunSummary, job_id: str, restarts: int | None) -> bool:
    """Whether a summary found in the run folder is the SLURM job's last attempt's (not an earlier attempt's, or an
    earlier job's in the same folder)."""
    slurm = summary.slurm or {}
    ids = {slurm.get("array_job"), slurm.get("job_id")} - {None}  # submitit's id of an array task: <array>_<task>
    if ids and job_id not in ids:
        return False
    return restarts is None or int(slurm.get("restart_count") or 0) == restarts


# ---- srun's account of the tasks that ended ----------------------------------------------------------------

# srun writes a line to the job's stderr for each task that ends badly, first the first: "srun: error: zt-node2:
# task 1: Killed" (strsignal's words), "... task 0: Exited with exit code 143", "srun: error: Node failure on zt-node2".
_TASK_END = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<tasks>[\d,-]+): (?P<how>.+)$")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<node>\S+)")
_EXIT_CODE = re.compile(r"^Exited with exit code (\d+)$")
_SIGNALS = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}

# Each attempt of a requeued job appends to its stderr; the batch script marks an attempt's start before its srun.
ATTEMPT_LINE = 'zerotune: SLURM job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}: the step starts'
_ATTEMPT = re.compile(r"^zerotune: SLURM job \S+, restart (\d+): the step starts$")


@dataclass(frozen=True)
class TaskEnd:
    """srun's line on a task that ended badly: the node (a host list where several ended alike at once), the tasks
    ("1", "0-3"; None for a node failure) and how ("Killed", "Exited with exit code 1", "Node failure")."""
    line: str
    node: str
    tasks: str | None
    how: str

    def record(self, ranks: list[int]) -> dict:
        """The error's account of it: a message, failed_node, failed_node_rank (failed_node_ranks for several),
        and srun's own line."""
        where = f"{self.node} (node{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if ranks \
            else self.node
        sig = _SIGNALS.get(self.how.removesuffix(" (core dumped)"))
        code = _EXIT_CODE.match(self.how)
        if self.tasks is None:
            message = f"{where} failed first"
        elif sig is not None:
            message = f"the job process on {where} ended first, killed by {sig}"
        elif code is not None:
            message = f"the job process on {where} ended first, with exit code {code[1]}"
        else:
            message = f"the job process on {where} ended first: {self.how}"
        out: dict = {"message": f"{message} (srun: \"{self.line.removeprefix('srun: error: ')}\")",
                     "failed_node": self.node, "srun": self.line}
        if len(ranks) == 1:
            out["failed_node_rank"] = ranks[0]
        elif ranks:
            out["failed_node_ranks"] = ranks
        if sig is not None:
            out["signal"] = sig
        elif code is not None:
            out["exit_code"] = int(code[1])
        return out


def first_task_end(text: str, restarts: int | None = None) -> TaskEnd | None:
    """srun's first line on a task that ended badly, in the job's stderr `text`: in the attempt after `restarts`
    requeues where the batch script marked its attempts (the last one where `restarts` is None)."""
    attempts: dict[int | None, list[str]] = {}  # restart count: its lines (None: before any mark)
    current = None
    for line in text.splitlines():
        if m := _ATTEMPT.match(line):
            current = int(m[1])
            attempts[current] = []
        else:
            attempts.setdefault(current, []).append(line)
    marked = [restart for restart in attempts if restart is not None]
    if marked:  # None: that attempt's srun never started
        lines = attempts.get(marked[-1] if restarts is None else restarts) or []
    else:  # no marks (a script of an earlier version): where requeued, its attempts' lines cannot be told apart
        lines = [] if restarts else attempts.get(None, [])
    for line in lines:
        if m := _TASK_END.match(line):
            return TaskEnd(line, m["node"], m["tasks"], m["how"].strip())
        if m := _NODE_FAILURE.match(line):
            return TaskEnd(line, m["node"], None, "Node failure")
    return None


def node_ranks(node: str, nodelist: str | None, job_id: str) -> list[int]:
    """The job's node indices (SLURM_NODEID) of `node` (a host list): their places in the job's node list, as
    `scontrol show hostnames` expands both; [] where SLURM cannot say."""
    nodelist = nodelist or (show_job(job_id) or {}).get("NodeList")
    if not nodelist:
        return []
    try:
        hosts = scontrol("show", "hostnames", nodelist).split()
        named = scontrol("show", "hostnames", node).split() if "[" in node or "," in node else [node]
    except (ConfigError, OSError, subprocess.SubprocessError):
        return []
    return [hosts.index(h) for h in named if h in hosts]


def srun_output(job) -> str:
    """The job's stderr, where srun writes: task 0's submitit log (the batch script's stderr)."""
    try:
        return Path(job.task(0).paths.stderr).read_text(errors="replace")
    except OSError:
        return ""




def task_command(executor: Any) -> str:
    """What srun runs on each node: submitit's task, its stop signals held from its first line."""
    return " ".join([executor.python, "-u -m zerotune.job.slurm_task", shlex.quote(str(executor.folder))])


def batch_script(executor: Any, command: str, uid: str) -> str:  # noqa: ARG001 (submitit's signature)
    """submitit's sbatch script, whose shell ignores the pre-emption signal: SLURM signals the shell too when
    asked to (`scancel --full`), and the shell, which only waits on srun, would end the job FAILED of it. Its
    last line before srun marks the attempt in the job's stderr, where srun says which task ended first."""
    from submitit.slurm.slurm import SlurmJobEnvironment, _make_sbatch_string

    setup = [f"trap '' {SlurmJobEnvironment.USR_SIG}", *(executor.parameters.get("setup") or []),
             f'echo "{ATTEMPT_LINE}" >&2']
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
    state = wait_for_end(job)
    failure = ""
    if state == "COMPLETED":
        try:
            return job.results()[0]
        except Exception as exc:  # submitit's FailedJobError: the task raised past Hydra (its traceback)
            failure = str(exc).strip().splitlines()[-1][:500]
    run_dir = run_dir_of()
    stderr, restarts = srun_output(job), job_restarts(str(job.job_id))
    # Every task's own error, where they raised; else srun's word on the task that ended first.
    ended_first = None if failure else first_task_end(stderr, restarts)
    summary = record_lost_job(run_dir, str(job.job_id), None if state == "COMPLETED" else state, overrides,
                                      failure or (stderr.splitlines() or [""])[-1], restarts=restarts,
                                      ended_first=ended_first)
    # COMPLETED, as zerotune's own task returns for a job that failed in a sweep: recorded, and the sweep goes on.
    return JobReturn(overrides=overrides, working_dir=str(run_dir), status=JobStatus.COMPLETED,
                     _return_value=summary)

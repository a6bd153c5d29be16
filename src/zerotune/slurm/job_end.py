"""How a SLURM job ended, read from SLURM itself, and the record of a job that ended without a result.

submitit learns a job's state from `sacct`. A cluster without accounting (no slurmdbd) has no `sacct`, and there
a job that ended without writing its result (cancelled, killed, its node lost) stays "UNKNOWN" to submitit, so a
sweep waiting on it waits forever. `squeue` and `scontrol` answer on every cluster: a job is over when it has
left the queue, and `scontrol` keeps its final state for a while after (MinJobAge, 300 s by default).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from zerotune.files import write_text_atomic
from zerotune.rundir import RunDir
from zerotune.rundir.run_summary import RunSummary
from zerotune.rundir.status import FINAL, Status
from zerotune.slurm.cluster import SCONTROL_TIMEOUT_S, parse_int, show_job

log = logging.getLogger(__name__)

# squeue's states of a job not over yet (a requeued job is PENDING again).
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
# What summary.json says of a job SLURM ended in these states without a result from it.
STATUS_OF_STATE = {"CANCELLED": Status.CANCELLED, "TIMEOUT": Status.TIMEOUT, "OUT_OF_MEMORY": Status.OOM,
                   "DEADLINE": Status.TIMEOUT}
# A summary the job itself wrote with a FINAL status keeps it: it is the more precise account.


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
                    restarts: int | None = None) -> RunSummary:
    """summary.json for a job SLURM ended without a result: its last attempt's own summary, if it wrote one, with
    SLURM's account added; its status from SLURM's state unless the job recorded a precise one itself.
    `restarts`: SLURM's count of the job's requeues. A summary an earlier attempt wrote (the last one ended before
    writing its own) stays that attempt's record, in attempts/<n>/, like any earlier attempt's."""
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
    said = (f"SLURM job {job_id} ended without a result (state {shown})"
            + (f": {detail}" if detail else ""))
    if summary.status not in FINAL:
        job_status = summary.status if summary.status is not None else summary.extra.pop("status", None)
        summary.error = {"type": "slurm", "message": said, "job_status": job_status, "job_error": summary.error}
        summary.status = STATUS_OF_STATE.get(str(state), Status.FAILED)
    elif summary.error is None and "error" not in summary.nulls:
        summary.error = {"type": "slurm", "message": said}
    summary.write(run_dir)
    hydra_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not hydra_overrides.exists():  # the report reads a job's parameters there (Hydra writes it when the job starts)
        hydra_overrides.parent.mkdir(exist_ok=True)
        write_text_atomic(hydra_overrides, yaml.safe_dump(list(overrides)))
    log.error("%s: %s", run_dir, said)
    return summary


def _last_attempts(summary: RunSummary, job_id: str, restarts: int | None) -> bool:
    """Whether a summary found in the run folder is the SLURM job's last attempt's (not an earlier attempt's, or an
    earlier job's in the same folder)."""
    slurm = summary.slurm or {}
    ids = {slurm.get("array_job"), slurm.get("job_id")} - {None}  # submitit's id of an array task: <array>_<task>
    if ids and job_id not in ids:
        return False
    return restarts is None or int(slurm.get("restart_count") or 0) == restarts


def stderr_tail(job, lines: int = 20) -> str:
    """The last lines task 0 wrote to stderr (submitit's log), for the record."""
    try:
        text = Path(job.task(0).paths.stderr).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])

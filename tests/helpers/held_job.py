"""A submitit job for tests/test_slurm_preemption.py. A task imports the job's code as it unpickles it (Hydra and
zerotune: seconds, before submitit installs its handler); with HELD_JOB_DIR set, importing this module says so
(`importing`) and waits for the test's word (`imported`), so that the test signals the task right then."""

from __future__ import annotations

import os
import time
from pathlib import Path

if os.environ.get("HELD_JOB_DIR"):
    (Path(os.environ["HELD_JOB_DIR"]) / "importing").touch()
    while not (Path(os.environ["HELD_JOB_DIR"]) / "imported").exists():
        time.sleep(0.05)


def held_job(folder: str) -> str:
    """Says it runs, waits for the test's word (`go`), then does what a job process does once its attempt is
    recorded: submitit's requeue, on the signal it held."""
    from zerotune.host import process
    from zerotune.job.slurm import requeue_if_preempted
    from zerotune.rundir.summary import RunSummary, Status

    Path(folder, "running").touch()
    while not Path(folder, "go").exists():
        time.sleep(0.05)
    Path(folder, "recorded").write_text(str(process.received()))
    requeue_if_preempted(RunSummary(status=Status.INTERRUPTED, interrupted={"job_signal": process.received()}))
    return "not requeued"

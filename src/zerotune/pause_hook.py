"""A test hook: hold a process for a while at a named moment, so that a test can signal it right there.

ZEROTUNE_TEST_PAUSE=<moment>[,<moment>...]:<seconds> and ZEROTUNE_TEST_PAUSE_DIR=<folder>: at each named moment
the process writes `<folder>/<moment>.<pid>` and sleeps. The moments: `before_workers` (the job process, before
it starts its workers), `worker_imports` (a worker, before its heavy imports), `engine_build` (a worker, before
accelerate/DeepSpeed wrap the model), `save-<step>` (every rank, in the middle of saving that step). Unset, it
costs one dictionary lookup. Standard library only: a worker calls it before its imports.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV, DIR_ENV = "ZEROTUNE_TEST_PAUSE", "ZEROTUNE_TEST_PAUSE_DIR"


def pause(moment: str) -> None:
    setting = os.environ.get(ENV)
    if not setting:
        return
    moments, _, seconds = setting.rpartition(":")
    if moment not in moments.split(","):
        return
    folder = Path(os.environ.get(DIR_ENV) or ".")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{moment}.{os.getpid()}").touch()
    time.sleep(float(seconds))  # a signal's handler runs in here; the sleep then goes on (PEP 475)

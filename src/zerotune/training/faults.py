"""Fault injection (`debug.*`), to rehearse what a job and a sweep do when training breaks.

It exists only when a debug key is set: `step_hook` returns None otherwise, and the training loop then
runs no fault code at all.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import torch

from zerotune.schema import Debug

log = logging.getLogger(__name__)

KEYS = ("fail_at_step", "oom_at_step", "hang_at_step", "kill_at_step", "host_alloc_mib")


def step_hook(debug: Debug, rank: int) -> Callable[[int], None] | None:
    """A function called before each step (with the steps done so far), or None when nothing is injected."""
    if not any(getattr(debug, k) is not None for k in KEYS):
        return None
    if debug.fail_rank is not None and int(debug.fail_rank) != rank:
        return None  # faults are injected on that rank only (null: every rank)

    def inject(step: int) -> None:
        if debug.fail_at_step == step:
            raise RuntimeError(f"debug.fail_at_step={step}: injected failure")
        if debug.oom_at_step == step:
            raise torch.OutOfMemoryError(f"debug.oom_at_step={step}: injected out of memory")
        if debug.hang_at_step == step:
            log.warning("debug.hang_at_step=%d: hanging", step)
            threading.Event().wait()
        if debug.kill_at_step == step:
            log.warning("debug.kill_at_step=%d: killing this rank (SIGKILL)", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if debug.host_alloc_mib and step == 1:
            # A known allocation, touched page by page and held for 3 s (many samples even on a busy machine),
            # for the host-peak honesty check.
            ballast = torch.ones(int(debug.host_alloc_mib) * 2**20 // 4, dtype=torch.float32)
            threading.Event().wait(3.0)
            del ballast

    return inject

"""Where a job's start-up time goes, from the command's start to the end of its first step.

The parent marks its phases (composition and imports, checks, prediction, op builds, launch); each worker
marks its own (start, imports done, engine ready, first step). summary.json's `startup` gives both, as
seconds, so a slow start points at its phase. All marks are epoch seconds (time.time(), the clock of
psutil's process create_time), so the two processes' marks compare.
"""

from __future__ import annotations

import time

import psutil

_jobs_in_this_process = 0


class ParentMarks:
    """The job parent's marks: `mark(name)` after each phase, in order.

    The first job of a process starts with the process; a sweep's later jobs start when the sweep reaches
    them (their imports are done already)."""

    def __init__(self) -> None:
        global _jobs_in_this_process
        self.start = psutil.Process().create_time() if _jobs_in_this_process == 0 else time.time()
        _jobs_in_this_process += 1
        self.marks: list[tuple[str, float]] = [("start", self.start)]

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def phases(self) -> dict:
        """Seconds per phase: each mark minus the one before it."""
        return {name: round(t - self.marks[i][1], 3) for i, (name, t) in enumerate(self.marks[1:])}


def startup_view(parent: ParentMarks | None, worker: dict | None) -> dict:
    """summary.json's `startup`: the parent's phases, the worker's, and the total to the first step.

    `worker`: rank 0's own marks (training/run.py): process_start, train_start, ready, first_step_end.
    """
    view: dict = {}
    if parent is not None:
        view["parent"] = parent.phases()
    if worker:
        launched = parent.marks[-1][1] if parent is not None else worker["process_start"]
        view["worker"] = {
            "start_and_imports_s": _seconds(launched, worker.get("train_start")),
            "setup_s": _seconds(worker.get("train_start"), worker.get("ready")),  # checks, model, data, engine
            "first_step_s": _seconds(worker.get("ready"), worker.get("first_step_end")),
        }
        start = parent.start if parent is not None else worker["process_start"]
        view["to_first_step_s"] = _seconds(start, worker.get("first_step_end"))
    if parent is not None:
        view["ops_build_s"] = view["parent"].get("ops_build")
    return view


def _seconds(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)

"""Where a job's start-up time goes, from the command's start to the end of its first step.

The parent marks its phases up to starting the workers (composition and imports, the launch block and the
checkpoint dir's lock, the launcher's imports). Its checks (the user's files, the DeepSpeed dict, the
plan, DeepSpeed's ops) then run while the workers import (launch/gate.py): they are marked apart. Each
worker marks its own phases (start and imports, waiting for the checks, setup, first step).
summary.json's `startup` gives them all as seconds, so a slow start points at its phase. All marks are
epoch seconds (time.time(), the clock of timing.process_start_time), so the processes' marks compare.
"""

from __future__ import annotations

import time

from zerotune.telemetry.timing import process_start_time

_jobs_in_this_process = 0


class Marks:
    """A sequence of phases: `mark(name)` at the end of each, in order."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.time() if start is None else start
        self.marks: list[tuple[str, float]] = [("start", self.start)]

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def phases(self) -> dict:
        """Seconds per phase: each mark minus the one before it."""
        return {name: round(t - self.marks[i][1], 3) for i, (name, t) in enumerate(self.marks[1:])}

    def end(self) -> float:
        return self.marks[-1][1]


class ParentMarks(Marks):
    """The job parent's own phases, up to starting the workers.

    The first job of a process starts with the process; a sweep's later jobs start when the sweep reaches
    them (their imports are done already)."""

    def __init__(self) -> None:
        global _jobs_in_this_process
        super().__init__(process_start_time() if _jobs_in_this_process == 0 else None)
        _jobs_in_this_process += 1


def startup_view(parent: ParentMarks | None, worker: dict | None, checks: Marks | None = None) -> dict:
    """summary.json's `startup`: the parent's phases, its checks (beside the workers' start), the worker's, and
    the total to the first step.

    `worker`: rank 0's own marks (training/run.py): process_start, train_start, ready, first_step_end, and
    gate_reached and gate_open when a zerotune parent started it.
    """
    view: dict = {}
    if parent is not None:
        view["parent"] = parent.phases()
    if checks is not None:
        view["checks"] = checks.phases()
    if worker:
        view["worker"] = _worker_phases(parent.end() if parent is not None else worker["process_start"], worker)
        # forked from a tune sweep's warm template (launch/warm.py), whose imports were paid once, before
        view["worker_start"] = "warm template" if worker.get("forked_from_template") else "fresh interpreter"
        start = parent.start if parent is not None else worker["process_start"]
        view["to_first_step_s"] = _seconds(start, worker.get("first_step_end"))
    if checks is not None:
        build = view["ops_build_s"] = view["checks"].get("ops_build")
        # A cold JIT build is a one-off, not this configuration's cost: what the workers waited on it comes off.
        waited = min(build or 0.0, (view.get("worker") or {}).get("waiting_for_checks_s") or 0.0)
        total = view.get("to_first_step_s")
        view["to_first_step_without_ops_build_s"] = None if total is None else round(total - waited, 3)
    return view


def gate_wait_s(worker: dict) -> float:
    """What a worker waited at the job's gate (the parent's checks and op builds); 0 without a gate."""
    reached, opened = worker.get("gate_reached"), worker.get("gate_open")
    return 0.0 if reached is None or opened is None else max(0.0, opened - reached)


def _worker_phases(launched: float, worker: dict) -> dict:
    reached = worker.get("gate_reached")
    if reached is None:  # started by torchrun & co.: no gate, its imports run up to train()
        return {"start_and_imports_s": _seconds(launched, worker.get("train_start")),
                "setup_s": _seconds(worker.get("train_start"), worker.get("ready")),
                "first_step_s": _seconds(worker.get("ready"), worker.get("first_step_end"))}
    return {"start_and_imports_s": _seconds(launched, reached),
            "waiting_for_checks_s": _seconds(reached, worker.get("gate_open")),
            "setup_s": _seconds(worker.get("gate_open"), worker.get("ready")),  # config, model, data, engine
            "first_step_s": _seconds(worker.get("ready"), worker.get("first_step_end"))}


def _seconds(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)

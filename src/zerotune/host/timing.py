"""Per-step wall time with device synchronisation, and where a job's start-up goes up to its first step (summary.json's
`startup`: the parent's phases, its checks beside the workers' imports, each worker's). All marks are epoch seconds
(time.time(), the clock of process_start_time), so the processes' marks compare."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable


def _noop() -> None:
    return None


def default_synchronize() -> Callable[[], None]:
    """torch.cuda.synchronize when CUDA is usable, else a no-op (CPU work is synchronous already)."""
    try:
        import torch
    except ImportError:
        return _noop
    return torch.cuda.synchronize if torch.cuda.is_available() else _noop


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default method)."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def process_start_time(pid: int | str = "self") -> float:
    """Epoch seconds at which the process was created (kernel clock-tick resolution, ~10 ms). By hand on Linux:
    psutil's create_time uses /proc/stat's boot time in whole seconds, up to a second early (0.83 s here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, AttributeError, IndexError, ValueError):  # not Linux
        import psutil

        return psutil.Process(None if pid == "self" else int(pid)).create_time()


class StepTimer:
    """Times training steps, synchronising the device before each clock read (GPU work is asynchronous). `clock`
    (monotonic) times steps; `wall_clock` (epoch seconds) times process start to the end of the first step."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        synchronize: Callable[[], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        process_start: float | None = None,
    ) -> None:
        self.clock = clock
        self.synchronize = default_synchronize() if synchronize is None else synchronize
        self.wall_clock = wall_clock
        self._process_start = process_start
        self._t0: float | None = None
        self.durations: list[float] = []
        self.samples: list[int] = []
        self.startup_s: float | None = None
        self.first_step_end_unix: float | None = None  # when the first step ended (epoch s): for the caller's clock

    def start_step(self) -> None:
        self.synchronize()
        self._t0 = self.clock()

    def end_step(self, samples: int) -> float:
        """Ends the step begun by start_step(); returns its duration in seconds."""
        if self._t0 is None:
            raise RuntimeError("end_step() without start_step()")
        self.synchronize()
        dt = self.clock() - self._t0
        self._t0 = None
        self.durations.append(dt)
        self.samples.append(samples)
        if len(self.durations) == 1:
            start = self._process_start if self._process_start is not None else process_start_time()
            self.first_step_end_unix = self.wall_clock()
            self.startup_s = self.first_step_end_unix - start
        return dt

    def summary(self, warmup_steps: int) -> dict[str, float | int | None]:
        """Statistics over the steps after the first `warmup_steps`; the result's `warmup_steps` is the number
        actually excluded (fewer if the run was shorter)."""
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        durations = self.durations[warmup_steps:]
        samples = self.samples[warmup_steps:]
        total = sum(durations)
        return {
            "step_time_median_s": statistics.median(durations) if durations else None,
            "step_time_p90_s": quantile(durations, 0.9) if durations else None,
            "samples_per_s": sum(samples) / total if durations and total > 0 else None,
            "steps_timed": len(durations),
            "warmup_steps": min(warmup_steps, len(self.durations)),
            "startup_s": self.startup_s,
            "first_step_end_unix": self.first_step_end_unix,
        }


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
    """The job parent's phases up to starting the workers: from the process's start for its first job, else from
    when the sweep reaches the job."""

    def __init__(self) -> None:
        global _jobs_in_this_process
        super().__init__(process_start_time() if _jobs_in_this_process == 0 else None)
        _jobs_in_this_process += 1


def startup_view(parent: ParentMarks | None, worker: dict | None, checks: Marks | None = None) -> dict:
    """summary.json's `startup`: the parent's phases, its checks, the worker's, and the total to the first step.
    `worker`: rank 0's marks (process_start, train_start, ready, first_step_end; gate_reached, gate_open)."""
    view: dict = {}
    if parent is not None:
        view["parent"] = parent.phases()
    if checks is not None:
        view["checks"] = checks.phases()
    if worker:
        view["worker"] = _worker_phases(parent.end() if parent is not None else worker["process_start"], worker)
        # forked from a tune sweep's warm template (job/warm.py), whose imports were paid once, before
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

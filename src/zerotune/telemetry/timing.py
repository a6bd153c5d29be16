"""Per-step wall time with device synchronisation, and time-to-first-step."""

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
    """Epoch seconds at which the process was created (kernel clock-tick resolution, ~10 ms).

    Written by hand on Linux because psutil's create_time adds the start's offset to the boot time as
    /proc/stat gives it, in whole seconds: it can be up to a second early (0.83 s on these machines),
    which a start-up figure would count. Here the process's age is read off the same boot-based clock."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, AttributeError, IndexError, ValueError):  # not Linux
        import psutil

        return psutil.Process(None if pid == "self" else int(pid)).create_time()


class StepTimer:
    """Times training steps. GPU work is asynchronous, so the device is synchronised before each clock read:
    otherwise a step would be charged for the previous step's kernels, or finish before its own ran.

    `clock` measures step durations (monotonic); `wall_clock` (epoch seconds, the base of
    process_start_time) measures startup, i.e. process start to the end of the first step.
    """

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
        """Statistics over the steps after the first `warmup_steps` (compilation, allocator growth, caches).

        `warmup_steps` in the result is the number of steps actually excluded (fewer if the run was shorter).
        """
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

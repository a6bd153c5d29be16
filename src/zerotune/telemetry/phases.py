"""The run's phases as measured: loading, caching, step, sampling (the planner's names, plan/phases.py), each
with its start and end (epoch s), torch's CUDA allocator peaks during it (its peak statistics are reset as each
phase begins) and the host RSS peak the memory sampler saw during it. None means unmeasured: no CUDA, or no
sample taken in the phase; never 0."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, TypedDict

from zerotune.telemetry.torch_memory import _torch_cuda
from zerotune.units import MIB


class MeasuredPhase(TypedDict):
    """One ended phase, as summary.json's memory.phases lists it."""

    phase: str
    start: float
    end: float
    gpu_max_reserved_mib: float | None
    gpu_max_allocated_mib: float | None
    host_peak_rss_mib: float | None


class PhaseTimeline:
    def __init__(self, sampler: Any = None) -> None:
        """`sampler`: a MemorySampler (its window of host RSS samples), or None."""
        self.sampler = sampler
        self.records: list[MeasuredPhase] = []
        self._open: tuple[str, float] | None = None  # the open phase's name and start

    def begin(self, name: str) -> None:
        """End the open phase (if any) and start `name`."""
        self.end()
        torch = _torch_cuda()
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        if self.sampler is not None:
            self.sampler.begin_window()
        self._open = (name, time.time())

    def end(self) -> None:
        if self._open is None:
            return
        (name, start), self._open = self._open, None
        end = time.time()
        torch = _torch_cuda()
        measured = torch is not None and torch.cuda.is_initialized()
        self.records.append(MeasuredPhase(
            phase=name, start=start, end=end,
            gpu_max_reserved_mib=torch.cuda.max_memory_reserved() / MIB if measured else None,
            gpu_max_allocated_mib=torch.cuda.max_memory_allocated() / MIB if measured else None,
            host_peak_rss_mib=self.sampler.end_window() if self.sampler is not None else None))

    def gpu_peaks(self) -> dict[str, float | None]:
        """The largest allocator peaks over the phases ended so far (None where none was measured)."""
        return {"gpu_max_reserved_mib": largest(r["gpu_max_reserved_mib"] for r in self.records),
                "gpu_max_allocated_mib": largest(r["gpu_max_allocated_mib"] for r in self.records)}


def largest(values: Iterable[float | None]) -> float | None:
    """The largest of the measured values; None where none was measured."""
    return max((v for v in values if v is not None), default=None)

"""The run's phases as measured: loading, caching, step, sampling (the planner's names, plan/phases.py), each
with its start and end (epoch s), torch's CUDA allocator peaks during it (its peak statistics are reset as each
phase begins) and the host RSS peak the memory sampler saw during it. None means unmeasured: no CUDA, or no
sample taken in the phase; never 0."""

from __future__ import annotations

import time
from typing import Any

from zerotune.telemetry.torch_memory import _torch_cuda
from zerotune.units import MIB


class PhaseTimeline:
    def __init__(self, sampler: Any = None) -> None:
        """`sampler`: a MemorySampler (its window of host RSS samples), or None."""
        self.sampler, self.records, self._open = sampler, [], None

    def begin(self, name: str) -> None:
        """End the open phase (if any) and start `name`."""
        self.end()
        torch = _torch_cuda()
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        if self.sampler is not None:
            self.sampler.begin_window()
        self._open = {"phase": name, "start": time.time()}

    def end(self) -> None:
        if self._open is None:
            return
        record, self._open = self._open, None
        record["end"] = time.time()
        torch = _torch_cuda()
        measured = torch is not None and torch.cuda.is_initialized()
        record["gpu_max_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB if measured else None
        record["gpu_max_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB if measured else None
        record["host_peak_rss_mib"] = self.sampler.end_window() if self.sampler is not None else None
        self.records.append(record)

    def gpu_peaks(self) -> dict[str, float | None]:
        """The largest allocator peaks over the phases ended so far (None where none was measured)."""
        out = {}
        for key in ("gpu_max_reserved_mib", "gpu_max_allocated_mib"):
            known = [r[key] for r in self.records if r.get(key) is not None]
            out[key] = max(known) if known else None
        return out

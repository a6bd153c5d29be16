"""PyTorch's own view of memory (its caching allocator's peaks, its pinned host pool), the run's phases as measured
(the planner's names, plan/phases.py; None means unmeasured, never 0), and a plot of a run's metrics.jsonl."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any, TypedDict

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from zerotune.config.schema import MIB


def _torch_cuda() -> Any:
    """torch, if it is importable and sees a CUDA device; else None. Creates no CUDA context."""
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            return None
    torch = sys.modules["torch"]
    return torch if torch.cuda.is_available() else None


def torch_cuda_memory_stats(device: Any = None) -> dict[str, float | int | None]:
    """PyTorch caching-allocator peaks (allocated, reserved) for this process: below nvidia-smi's figure, which
    includes the CUDA context, cuBLAS/NCCL workspaces and anything allocated outside the allocator."""
    torch = _torch_cuda()
    if torch is None:
        return {"gpu_peak_allocated_mib": None, "gpu_peak_reserved_mib": None, "alloc_retries": None, "ooms": None}
    stats = torch.cuda.memory_stats(device)  # {} until the allocator has been used
    return {
        "gpu_peak_allocated_mib": stats.get("allocated_bytes.all.peak", 0) / MIB,
        "gpu_peak_reserved_mib": stats.get("reserved_bytes.all.peak", 0) / MIB,
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "ooms": int(stats.get("num_ooms", 0)),
    }


def pinned_memory_mib() -> float | None:
    """Peak MiB of PyTorch's CUDA host caching allocator (pin_memory: how DeepSpeed pins CPU-offload buffers); not
    memory pinned behind its back (cudaHostRegister, DeepSpeed's aio buffers). Sizes round up to powers of two and
    the peak is best-effort. None without CUDA or the `allocated_bytes.peak` host statistic."""
    torch = _torch_cuda()
    if torch is None or not hasattr(torch.cuda.memory, "host_memory_stats"):
        return None
    try:
        stats = torch.cuda.memory.host_memory_stats()
    except Exception:
        return None
    peak = stats.get("allocated_bytes.peak")
    return None if peak is None else peak / MIB


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


STEP_TIME_KEY = "perf/step_time_s"
MEMORY_PREFIX = "memory/"


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for rows where `key` has a non-null value."""
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_run(metrics_jsonl_path: str | os.PathLike[str], out_png: str | os.PathLike[str]) -> str:
    """Writes a 2-panel PNG: every `memory/*` series with at least one value (host RSS, GPU when measured,
    NVMe...) and `perf/step_time_s`, both against `step`. Returns the PNG path."""
    with open(metrics_jsonl_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    memory_keys = sorted({k for r in rows for k, v in r.items() if k.startswith(MEMORY_PREFIX) and v is not None})

    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_mem, ax_time = fig.subplots(2, 1, sharex=True)

    for key in memory_keys:
        xs, ys = _series(rows, key)
        ax_mem.plot(xs, ys, marker=".", label=key.removeprefix(MEMORY_PREFIX))
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("memory")
    if memory_keys:
        ax_mem.legend(loc="best", fontsize="small")
    else:
        ax_mem.text(0.5, 0.5, "no memory metrics", ha="center", va="center", transform=ax_mem.transAxes)

    xs, ys = _series(rows, STEP_TIME_KEY)
    ax_time.plot(xs, ys, marker=".", color="tab:red")
    ax_time.set_ylabel("s")
    ax_time.set_title("step time")
    ax_time.set_xlabel("step")

    out = os.fspath(out_png)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100)
    return out

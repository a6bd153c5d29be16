"""PyTorch's own view of CUDA memory: its caching allocator's peaks and its pinned host pool."""

from __future__ import annotations

import sys
from typing import Any

from zerotune.units import MIB


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
    """PyTorch caching-allocator peaks for this process (what the allocator handed out and reserved).

    Lower than nvidia-smi's figure: it excludes the CUDA context, cuBLAS/NCCL workspaces and anything
    allocated outside PyTorch's allocator.
    """
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
    """Peak bytes (MiB) of page-locked host memory owned by PyTorch's CUDA host caching allocator.

    That pool serves `tensor.pin_memory()`, `pin_memory=True` DataLoaders and `torch.empty(..., pin_memory=True)`,
    which is how DeepSpeed's accelerator pins CPU-offload buffers. It does not see memory pinned behind
    PyTorch's back (`cudaHostRegister`, DeepSpeed's aio page-locked buffers allocated in C++). Sizes are
    rounded up to powers of two and torch documents the peak as best-effort. None without CUDA, or when
    this torch does not report the `allocated_bytes.peak` host statistic.
    """
    torch = _torch_cuda()
    if torch is None or not hasattr(torch.cuda.memory, "host_memory_stats"):
        return None
    try:
        stats = torch.cuda.memory.host_memory_stats()
    except Exception:
        return None
    peak = stats.get("allocated_bytes.peak")
    return None if peak is None else peak / MIB

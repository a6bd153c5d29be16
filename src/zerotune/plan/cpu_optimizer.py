"""The CPU optimizer step's time floor: DeepSpeed's CPU-Adam, timed once on this host, per parameter.

Measured, not looked up: its speed depends on the host's cores and SIMD width. The figure is cached per
host and thread count in the planner's cache folder; a host where the op cannot be built gets None
(unmeasured), never a guess.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from zerotune import files

PROBE_PARAMS = 4_000_000   # large enough that per-call overhead is a small share
REPEATS = 5


def cache_dir() -> Path:
    return files.cache_dir("plan")


def _host_key() -> str:
    return f"{platform.node()}|{platform.processor() or platform.machine()}|{torch.get_num_threads()}threads"


def seconds_per_param() -> float | None:
    """Median seconds CPU-Adam takes per parameter per step on this host (cached), or None if unmeasurable."""
    file = cache_dir() / "cpu_adam.json"
    known = json.loads(file.read_text()) if file.is_file() else {}
    if _host_key() in known:
        return known[_host_key()]
    measured = _measure()
    if measured is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({**known, _host_key(): measured}, indent=1))
    return measured


def _measure() -> float | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param = torch.nn.Parameter(torch.zeros(PROBE_PARAMS))
        param.grad = torch.full_like(param, 1e-3)
        optimizer = DeepSpeedCPUAdam([param], lr=1e-4)
    except Exception:  # noqa: BLE001 (no compiler, no op: the floor is unmeasured, the plan goes on)
        return None
    optimizer.step()  # first step allocates the moments
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / PROBE_PARAMS

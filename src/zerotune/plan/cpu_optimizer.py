"""The CPU optimizer step's time floor: DeepSpeed's CPU-Adam timed on this host (its cores, SIMD and memory
bandwidth decide it), cached per host and thread count. None (unmeasured), never a guess, where the op cannot be
built or is not built yet: building takes minutes (about 75 s of two cores), which a plan does not spend."""

from __future__ import annotations

import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from zerotune.config import files
from zerotune.host.ops import is_cached
from zerotune.host.ops_env import link_torch_lib, remember_cpu_info

# The probe spans well past the LLC, like a model's partitions: one that fits the cache times a faster op (issue
# 29: 0.19 ns/param at 4M, 0.24 at 200M), and where each step pays a few fixed ms (OpenMP's threads waking) a
# small one a slower op (4M: about 2.0 ns/param, 200M: 0.76-0.95; experiments/results/planner.md).
MIN_PROBE_PARAMS = 50_000_000   # 200 MB of fp32 parameters: past any common LLC
PROBE_LLC_MULTIPLE = 8          # the probe's fp32 parameters span 8× the last-level cache
PROBE_BYTES_PER_PARAM = 16      # the probe holds fp32 param + grad + two Adam moments
MEMORY_SHARE = 8                # the probe takes at most 1/8 of the available memory
REPEATS = 5                     # timed steps after the warm-up step; their median is the figure
OP = "cpu_adam"                 # DeepSpeed's CPUAdamBuilder's op, in the torch extensions cache
CACHE_FILE = "cpu_adam_v3.json"  # v2 keyed each figure by the probe size; v1 timed 4M parameters: not reused
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest cache cpu0 sees (its last level), from sysfs; None where sysfs does not say."""
    sizes = []
    for index in sysfs.glob("index*"):
        try:
            match = _SIZE.match((index / "size").read_text())
        except OSError:
            continue
        if match:
            sizes.append(int(match.group(1)) * _UNITS[match.group(2).upper()])
    return max(sizes) if sizes else None


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)  # /proc/meminfo's MemAvailable on Linux


def probe_params(llc_bytes: int | None = None, avail_bytes: int | None = None) -> int:
    """How many parameters the probe steps: past the LLC (at least MIN_PROBE_PARAMS), within its memory share."""
    size = full_probe_params(llc_bytes)
    avail = available_bytes() if avail_bytes is None else avail_bytes
    return min(size, avail // MEMORY_SHARE // PROBE_BYTES_PER_PARAM) if avail else size


def full_probe_params(llc_bytes: int | None = None) -> int:
    """The probe's size where memory allows: PROBE_LLC_MULTIPLE × the LLC, at least MIN_PROBE_PARAMS."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    return max(MIN_PROBE_PARAMS, PROBE_LLC_MULTIPLE * (llc or 0) // 4)


def host_key() -> str:
    """The cache key: host, CPU and torch's thread count (CPU-Adam's OpenMP threads)."""
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()}|{cpu}|{torch.get_num_threads()}threads"


@dataclass(frozen=True)
class CpuAdamFigure:
    s_per_param: float  # median seconds per parameter per step
    params: int         # the probe's size when it was timed
    timed_now: bool     # False: read from this host's cache, no probe ran


def cpu_adam_figure() -> CpuAdamFigure | None:
    """CPU-Adam's median seconds per parameter per step on this host (cached), or None if unmeasurable."""
    file = files.cache_dir("plan") / CACHE_FILE
    known = files.read_json(file)
    known = known if isinstance(known, dict) else {}
    llc = last_level_cache_bytes()  # read once: both sizes below follow it
    cached, params, full = known.get(host_key()), probe_params(llc), full_probe_params(llc)
    # Reused unless memory capped its probe and the whole probe fits now: free memory moves by a little from
    # run to run, and re-timing whenever a slightly bigger capped probe fits would time it in most jobs.
    if isinstance(cached, dict) and (cached.get("params", 0) >= params or params < full):
        return CpuAdamFigure(float(cached["s_per_param"]), int(cached["params"]), timed_now=False)
    if not op_built():
        return None
    measured = time_step(params)
    if measured is None:
        return None
    files.write_cached_json(file, {**known, host_key(): {"s_per_param": measured, "params": params}})
    return CpuAdamFigure(measured, params, timed_now=True)


def op_built() -> bool:
    return is_cached(OP)


def why_unmeasured() -> str:
    """Why cpu_adam_figure() is None."""
    if not op_built():
        return ("DeepSpeed's CPU-Adam is not built on this host yet (minutes to build; `python -m zerotune.host.ops` "
                "builds it, and so does the first job that offloads): the next plan times it")
    return "DeepSpeed's CPU-Adam could not be built or run here"


def time_step(params: int, repeats: int = REPEATS) -> float | None:
    """Seconds per parameter of one DeepSpeedCPUAdam step over `params` fp32 parameters: the median of
    `repeats` steps after a warm-up step (which allocates the moments). None where the op cannot be built."""
    optimizer = build_optimizer(params)
    if optimizer is None:
        return None
    optimizer.step()
    times = [timed_step(optimizer) for _ in range(repeats)]
    return sorted(times)[len(times) // 2] / params


def build_optimizer(params: int) -> torch.optim.Optimizer | None:
    """DeepSpeedCPUAdam over one fp32 parameter of `params` elements with its gradient set, or None where the
    op cannot be built (no compiler, no op, no memory)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        link_torch_lib()  # torch under a path with a space: the op links through a link to its libraries
        remember_cpu_info()  # CPU-Adam and its builder ask py-cpuinfo: a new interpreter per question
        param = torch.nn.Parameter(torch.zeros(params))
        param.grad = torch.full_like(param, 1e-3)
        return DeepSpeedCPUAdam([param], lr=1e-4)
    except Exception:  # noqa: BLE001 (the floor is unmeasured, the plan goes on)
        return None


def timed_step(optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start

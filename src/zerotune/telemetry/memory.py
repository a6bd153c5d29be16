"""Peak memory telemetry: host RSS of the process tree, NVMe swap bytes, GPU memory as nvidia-smi sees it.

A background thread samples at a fixed interval and keeps running maxima; the trainer also calls
`sample_now()` at step boundaries so that the peak of every step is seen at least once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import psutil

log = logging.getLogger(__name__)

MIB = float(1 << 20)

# Why 0.05 s: a diffusion U-Net step takes ~0.1-1 s and the transient peaks we care about (optimizer step,
# ZeRO gather/partition, offload copies) last tens of milliseconds, so 20 Hz sees them; the trainer's
# `sample_now()` at step boundaries covers the rest. Cost: one sample of a small process tree takes
# ~0.05 ms of CPU hot, ~0.25 ms as a thread waking every 50 ms, i.e. ~0.5% of one core
# (benchmarks/bench_telemetry_overhead.py; step-time overhead was within the +-2% noise of a shared box).
DEFAULT_INTERVAL_S = 0.05

# wandb's service process (and its GPU/system monitor helpers) is a child of the trainer. It belongs to the
# logger, not to the ZeRO configuration being measured, so its subtree is left out by default.
DEFAULT_EXCLUDE_NAMES: tuple[str, ...] = ("wandb-core",)

KEYS = ("host_peak_rss_mib", "nvme_peak_mib", "gpu_peak_process_mib", "gpu_peak_device_mib")
# /proc/<pid>/ns/pid of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
_INIT_PID_NS = "pid:[4026531836]"


def _max(a: float | None, b: float | None) -> float | None:
    """Running maximum where None means "not measured" and never beats a number."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _dir_bytes(path: str) -> int:
    """Recursive sum of file sizes; files/dirs deleted mid-walk (swap files come and go) are skipped."""
    total = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
    return total


def _child_pids(pid: int) -> list[int] | None:
    """Direct children via /proc/<pid>/task/*/children: cost scales with the tree, not with every process
    on the node (psutil.children() scans all of /proc). None when the kernel lacks CONFIG_PROC_CHILDREN."""
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    kids: list[int] = []
    for tid in tids:  # a child belongs to the thread that forked it, so read every thread
        try:
            with open(f"{task_dir}/{tid}/children") as f:
                kids.extend(int(x) for x in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}"):
                return []
            if not os.path.exists(f"{task_dir}/{tid}"):
                continue  # thread exited mid-scan
            return None  # file not provided by this kernel
        except OSError:
            continue
    return kids


def _in_child_pid_namespace() -> bool:
    """True in a container with its own PID namespace: NVML then reports host PIDs that match none of ours."""
    try:
        return os.readlink("/proc/self/ns/pid") != _INIT_PID_NS
    except OSError:
        return False


class _Nvml:
    """The NVML handle of the CUDA device this process uses; `ok` is False without NVML or a visible GPU."""

    def __init__(self, cuda_index: int) -> None:
        self.ok = False
        self.handle: Any = None
        self.pynvml: Any = None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
            return  # CUDA was told to see no device
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                return
            self.handle = self._resolve(pynvml, cuda_index, visible)
            self.pynvml = pynvml
            self.ok = True
        except Exception as e:  # no library, no driver, no such device: all mean "not measured"
            log.debug("NVML unavailable: %s", e)

    @staticmethod
    def _resolve(pynvml: Any, cuda_index: int, visible: str | None) -> Any:
        # NVML numbers devices physically and ignores CUDA_VISIBLE_DEVICES, so map the CUDA ordinal through it.
        if visible:
            entry = visible.split(",")[cuda_index].strip()
            if entry.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            return pynvml.nvmlDeviceGetHandleByUUID(entry)  # GPU-... or MIG-...
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)

    def device_used_bytes(self) -> int:
        p = self.pynvml
        try:  # v2 separates driver-reserved memory; its `used` is what current nvidia-smi prints
            return int(p.nvmlDeviceGetMemoryInfo(self.handle, version=p.nvmlMemory_v2).used)
        except Exception:
            return int(p.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used_bytes(self) -> dict[int, int | None]:
        # usedGpuMemory is None where the driver cannot attribute memory (NVML_VALUE_NOT_AVAILABLE).
        procs = self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {int(p.pid): p.usedGpuMemory for p in procs}


class MemorySampler:
    """Samples memory in a daemon thread and keeps peaks. Thread-safe; all values are MiB floats or None.

    None means "not measured" (no NVML/GPU, no nvme_dir), never zero.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        pid: int | None = None,
        nvme_dir: str | os.PathLike[str] | None = None,
        cuda_index: int | None = None,
        exclude_names: tuple[str, ...] = DEFAULT_EXCLUDE_NAMES,
        include_root: bool = True,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.pid = os.getpid() if pid is None else pid
        # False: only the descendants count (a launcher measuring its workers, not itself).
        self.include_root = include_root
        self.nvme_dir = None if nvme_dir is None else os.fspath(nvme_dir)
        self.exclude_names = tuple(exclude_names)
        if cuda_index is None:
            cuda_index = int(os.environ.get("LOCAL_RANK", "0"))
        self._nvml = _Nvml(cuda_index)
        self._container_pids = _in_child_pid_namespace()
        self._warned_pid_ns = False

        self._procs: dict[int, psutil.Process] = {}  # cached so name() and pid reuse checks stay cheap
        self._sample_lock = threading.Lock()  # serialises sampling (thread vs. sample_now)
        self._state_lock = threading.Lock()  # guards _current/_peaks/_stats
        self._current: dict[str, float | None] = dict.fromkeys(KEYS)
        self._peaks: dict[str, float | None] = dict.fromkeys(KEYS)
        self._n_samples = 0
        self._sample_time_s = 0.0
        self._sample_cpu_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MemorySampler:
        if self._thread is not None:
            raise RuntimeError("MemorySampler already started")
        self._stop.clear()
        self.sample_now()  # a baseline even if the run is shorter than one interval
        self._thread = threading.Thread(target=self._run, name="zerotune-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops and joins the thread, then takes a last sample. Safe to call more than once."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self.sample_now()

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_now()
            except Exception:  # keep sampling; a telemetry bug must not kill the run
                log.exception("memory sample failed")

    # ------------------------------------------------------------------ sampling
    def sample_now(self) -> dict[str, float | None]:
        """Takes one sample synchronously, updates peaks and returns the sample."""
        with self._sample_lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            pids = self._tree()
            sample = {
                "host_peak_rss_mib": self._rss_bytes(pids) / MIB,
                "nvme_peak_mib": None if self.nvme_dir is None else _dir_bytes(self.nvme_dir) / MIB,
                "gpu_peak_process_mib": None,
                "gpu_peak_device_mib": None,
            }
            if self._nvml.ok:
                sample["gpu_peak_process_mib"], sample["gpu_peak_device_mib"] = self._gpu_mib(pids)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        with self._state_lock:
            self._current = sample
            self._peaks = {k: _max(self._peaks[k], v) for k, v in sample.items()}
            self._n_samples += 1
            self._sample_time_s += dt
            self._sample_cpu_s += dc
        return dict(sample)

    def _proc(self, pid: int) -> psutil.Process | None:
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                return None
            self._procs[pid] = proc
        return proc

    def _children(self, pid: int) -> list[int]:
        kids = _child_pids(pid)
        if kids is not None:
            return kids
        proc = self._proc(pid)  # portable fallback: scans every process on the machine
        try:
            return [c.pid for c in proc.children()] if proc else []
        except psutil.Error:
            return []

    def _tree(self) -> list[int]:
        """The root pid and all its descendants, minus excluded subtrees."""
        pids: list[int] = []
        stack = [self.pid]
        while stack:
            pid = stack.pop()
            if pid != self.pid and self.exclude_names:
                proc = self._proc(pid)
                try:
                    if proc is None or proc.name() in self.exclude_names:
                        continue
                except psutil.Error:
                    continue
            if pid != self.pid or self.include_root:
                pids.append(pid)
            stack.extend(self._children(pid))
        for gone in set(self._procs) - set(pids):
            del self._procs[gone]
        return pids

    def _rss_bytes(self, pids: list[int]) -> int:
        # Plain RSS summed over processes: pages shared between them (fork copy-on-write, shared libs, shm)
        # count once per process. PSS would be exact but reads /proc/<pid>/smaps, far too slow at 20 Hz.
        total = 0
        for pid in pids:
            proc = self._proc(pid)
            try:
                total += proc.memory_info().rss if proc else 0
            except psutil.Error:  # vanished mid-scan
                continue
        return total

    def _gpu_mib(self, pids: list[int]) -> tuple[float | None, float | None]:
        try:
            device = self._nvml.device_used_bytes() / MIB
            per_pid = self._nvml.process_used_bytes()
        except Exception as e:
            log.debug("NVML query failed: %s", e)
            return None, None
        ours = [per_pid[p] for p in pids if p in per_pid]
        known = [b for b in ours if b is not None]
        if known:
            return sum(known) / MIB, device
        if ours:  # our processes are listed but the driver cannot attribute their memory
            return None, device
        if self._container_pids:
            # NVML lists host-namespace PIDs; from inside a container none of ours match, so "0" would lie.
            if not self._warned_pid_ns and per_pid:
                log.warning("NVML process PIDs do not match this PID namespace; per-process GPU memory is None")
                self._warned_pid_ns = True
            return None, device
        return 0.0, device  # no process of the tree holds a CUDA context (yet)

    # ------------------------------------------------------------------ results
    def peaks(self) -> dict[str, float | None]:
        with self._state_lock:
            return dict(self._peaks)

    def current(self) -> dict[str, float | None]:
        """The latest sample, under the same keys as peaks()."""
        with self._state_lock:
            return dict(self._current)

    def stats(self) -> dict[str, float | int]:
        """How many samples were taken and what one costs: wall time inside sample_now (includes waiting for
        the GIL and the CPU) and the sampling thread's own CPU time."""
        with self._state_lock:
            n, t, c = self._n_samples, self._sample_time_s, self._sample_cpu_s
        return {
            "samples": n,
            "mean_sample_ms": 1e3 * t / n if n else 0.0,
            "mean_sample_cpu_ms": 1e3 * c / n if n else 0.0,
        }

    @property
    def gpu_available(self) -> bool:
        return self._nvml.ok


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

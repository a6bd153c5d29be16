"""Peak memory telemetry: host RSS of the process tree, NVMe swap bytes, GPU memory as nvidia-smi sees it (NVML),
walked cheaply while processes and swap files come and go. A background thread keeps running maxima; the trainer
also calls `sample_now()` at step boundaries so that the peak of every step is seen at least once."""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Self

import psutil

from zerotune.config.schema import MIB


def dir_bytes(path: str) -> int:
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


def child_pids(pid: int) -> list[int] | None:
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
            kids.extend(int(x) for x in _read_raw(f"{task_dir}/{tid}/children").split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}"):
                return []
            if not os.path.exists(f"{task_dir}/{tid}"):
                continue  # thread exited mid-scan
            return None  # file not provided by this kernel
        except OSError:
            continue
    return kids


def _read_raw(path: str) -> bytes:
    """A small /proc file in 3 syscalls (open() takes 7): read per thread of every watched process at 20 Hz."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _read(path: str) -> bytes | None:
    try:
        return _read_raw(path)
    except OSError:
        return None


def unexeced_child_bytes(pid: int, ppid: int) -> int | None:
    """What a child not yet exec'd (same command line as its parent) holds of its own: 0 when vforked (the same
    statm), its private pages (smaps_rollup) when forked; None when it is not such a child or /proc cannot say.
    Its RSS would count its parent's pages again (a worker of 800 MiB: 800 MiB more before the exec)."""
    mine = _read(f"/proc/{pid}/cmdline")
    if not mine or mine != _read(f"/proc/{ppid}/cmdline"):
        return None
    statm = _read(f"/proc/{pid}/statm")
    if statm is not None and statm == _read(f"/proc/{ppid}/statm"):
        return 0
    rollup = (_read(f"/proc/{pid}/smaps_rollup") or b"").decode(errors="replace")
    private = [int(line.split()[1]) for line in rollup.splitlines() if line.startswith(("Private_Clean:", "Private_Dirty:"))]
    return sum(private) * 1024 if private else None


log = logging.getLogger(__name__)

# /proc/<pid>/ns/pid of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
_INIT_PID_NS = "pid:[4026531836]"


def in_child_pid_namespace() -> bool:
    """True in a container with its own PID namespace: NVML then reports host PIDs that match none of ours."""
    try:
        return os.readlink("/proc/self/ns/pid") != _INIT_PID_NS
    except OSError:
        return False


class Nvml:
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
            # NVML numbers devices physically and ignores CUDA_VISIBLE_DEVICES, so map the CUDA ordinal through it.
            entry = visible.split(",")[cuda_index].strip() if visible else str(cuda_index)
            self.handle = (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                           else pynvml.nvmlDeviceGetHandleByUUID(entry))  # GPU-... or MIG-...
            self.pynvml = pynvml
            self.ok = True
        except Exception as e:  # no library, no driver, no such device: all mean "not measured"
            log.debug("NVML unavailable: %s", e)

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



# Why 0.05 s: a U-Net step takes ~0.1-1 s and its transient peaks (optimizer step, ZeRO gather, offload copies)
# last tens of ms, so 20 Hz sees them. Cost ~0.25 ms a sample as a waking thread, ~0.5% of one core
# (benchmarks/bench_telemetry_overhead.py; step-time overhead within the +-2% noise of a shared box).
DEFAULT_INTERVAL_S = 0.05

# wandb's service process is the logger's, not the measured configuration's: its subtree is left out by default.
DEFAULT_EXCLUDE_NAMES: tuple[str, ...] = ("wandb-core",)

KEYS = ("host_peak_rss_mib", "nvme_peak_mib", "gpu_peak_process_mib", "gpu_peak_device_mib")


def _max(a: float | None, b: float | None) -> float | None:
    """Running maximum where None means "not measured" and never beats a number."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


class ProcessTree:
    """A process and its descendants (minus subtrees of excluded names), walked cheaply many times a second:
    psutil handles are cached so name() and pid reuse checks stay cheap."""

    def __init__(self, root: int, include_root: bool = True, exclude_names: tuple[str, ...] = (),
                 skip_pids: frozenset[int] = frozenset()) -> None:
        self.root, self.include_root, self.exclude_names = root, include_root, tuple(exclude_names)
        # not counted, though their children are: a warm template (job/warm.py), whose forked workers are
        # the job's and count whole, as a fresh worker would
        self.skip_pids = skip_pids
        self._procs: dict[int, psutil.Process] = {}

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
        kids = child_pids(pid)
        if kids is not None:
            return kids
        proc = self._proc(pid)  # portable fallback: scans every process on the machine
        try:
            return [c.pid for c in proc.children()] if proc else []
        except psutil.Error:
            return []

    def pids(self) -> list[int]:
        """The root pid (when included) and all its descendants, minus excluded subtrees."""
        pids: list[int] = []
        stack = [self.root]
        while stack:
            pid = stack.pop()
            if pid != self.root and self.exclude_names:
                proc = self._proc(pid)
                try:
                    if proc is None or proc.name() in self.exclude_names:
                        continue
                except psutil.Error:
                    continue
            if (pid != self.root or self.include_root) and pid not in self.skip_pids:
                pids.append(pid)
            stack.extend(self._children(pid))
        for gone in set(self._procs) - set(pids):
            del self._procs[gone]
        return pids

    def rss_bytes(self, pids: list[int]) -> int:
        # Plain RSS summed: shared pages count once per process. PSS would be exact but reads smaps, far too slow
        # at 20 Hz. A child between fork and exec counts its own pages only.
        inside, total = set(pids), 0
        for pid in pids:
            proc = self._proc(pid)
            if proc is None:
                continue
            try:
                parent = proc.ppid()
                own = unexeced_child_bytes(pid, parent) if parent in inside else None
                total += proc.memory_info().rss if own is None else own
            except psutil.Error:  # vanished mid-scan
                continue
        return total


class Periodic(ABC):
    """Calls `sample_now()` at start, then every `interval_s` in a daemon thread until `stop()`."""

    thread_name = "zerotune-sampler"

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @abstractmethod
    def sample_now(self) -> object:
        """Takes one sample now (also called from the thread)."""

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._stop.clear()
        self.sample_now()  # a baseline even if the run is shorter than one interval
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> bool:
        """Stops and joins the thread; False where it was not running. Safe to call more than once."""
        thread, self._thread = self._thread, None
        if thread is None:
            return False
        self._stop.set()
        thread.join()
        return True

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_now()
            except Exception:  # keep sampling; a telemetry bug must not kill the run
                log.exception("%s: a sample failed", self.thread_name)


class MemorySampler(Periodic):
    """Samples memory in a daemon thread and keeps peaks. Thread-safe; all values are MiB floats, or None for
    "not measured" (no NVML/GPU, no nvme_dir), never zero."""

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        pid: int | None = None,
        nvme_dir: str | os.PathLike[str] | None = None,
        cuda_index: int | None = None,
        exclude_names: tuple[str, ...] = DEFAULT_EXCLUDE_NAMES,
        include_root: bool = True,
        skip_pids: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(interval_s)
        self.pid = os.getpid() if pid is None else pid
        self.nvme_dir = None if nvme_dir is None else os.fspath(nvme_dir)
        self._nvml = Nvml(int(os.environ.get("LOCAL_RANK", "0")) if cuda_index is None else cuda_index)
        self._container_pids = in_child_pid_namespace()
        self._warned_pid_ns = False

        # include_root False: only the descendants count (a launcher measuring its workers, not itself).
        self._tree = ProcessTree(self.pid, include_root, exclude_names, skip_pids)
        self._sample_lock = threading.Lock()  # serialises sampling (thread vs. sample_now)
        self._state_lock = threading.Lock()  # guards _peaks/_window/_stats
        self._peaks: dict[str, float | None] = dict.fromkeys(KEYS)
        self._window: float | None = None  # host RSS peak since begin_window(); None: no window open
        self._window_open = False
        self._n_samples = 0
        self._sample_time_s = 0.0
        self._sample_cpu_s = 0.0

    thread_name = "zerotune-memory-sampler"

    def stop(self) -> bool:
        """Stops and joins the thread, then takes a last sample."""
        stopped = super().stop()
        if stopped:
            self.sample_now()
        return stopped

    def sample_now(self) -> dict[str, float | None]:
        """Takes one sample synchronously, updates peaks and returns the sample."""
        with self._sample_lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            pids = self._tree.pids()
            sample = {
                "host_peak_rss_mib": self._tree.rss_bytes(pids) / MIB,
                "nvme_peak_mib": None if self.nvme_dir is None else dir_bytes(self.nvme_dir) / MIB,
                "gpu_peak_process_mib": None,
                "gpu_peak_device_mib": None,
            }
            if self._nvml.ok:
                sample["gpu_peak_process_mib"], sample["gpu_peak_device_mib"] = self._gpu_mib(pids)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        with self._state_lock:
            self._peaks = {k: _max(self._peaks[k], v) for k, v in sample.items()}
            if self._window_open:
                self._window = _max(self._window, sample["host_peak_rss_mib"])
            self._n_samples += 1
            self._sample_time_s += dt
            self._sample_cpu_s += dc
        return dict(sample)

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

    def begin_window(self) -> None:
        """Start a window of its own peak (a run's phase, host/torch_memory.py), with a sample at its start."""
        with self._state_lock:
            self._window, self._window_open = None, True
        self.sample_now()

    def end_window(self) -> float | None:
        """The host RSS peak (MiB) of the samples since begin_window(), one taken now included."""
        self.sample_now()
        with self._state_lock:
            peak, self._window, self._window_open = self._window, None, False
        return peak

    def peaks(self) -> dict[str, float | None]:
        with self._state_lock:
            return dict(self._peaks)

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

"""Host memory as the kernel rations it (the machine's and this process's cgroup's limits), a watch on it while a
job's workers run, and the kernel's record of an OOM kill: what the watch saw before a worker vanished tells the
OOM killer's silent SIGKILL apart from a kill by a person or a scheduler."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import psutil

from zerotune.config.schema import MIB
from zerotune.host.memory import Periodic, ProcessTree, in_child_pid_namespace

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A cgroup v1 "no limit" is the largest page-aligned 64-bit value; anything past this is no limit.
_NO_LIMIT_BYTES = 1 << 60
# How close to the limit counts as out of memory: the kernel kills once reclaim fails, a little before the last
# byte, and a watch sampling every 0.1 s misses the final climb of a fast allocation.
MARGIN_MIB = 256.0
MARGIN_FRACTION = 0.05


@dataclass(frozen=True)
class HostMemory:
    """One reading, MiB. cgroup figures are None where no limit is set (or none can be read)."""

    total_mib: float
    available_mib: float                 # the kernel's estimate of what can be allocated without swapping
    cgroup_limit_mib: float | None = None
    cgroup_used_mib: float | None = None

    @property
    def limit_mib(self) -> float:
        """The most this process's cgroup can hold: the machine's memory or the cgroup's limit."""
        return min(self.total_mib, self.cgroup_limit_mib) if self.cgroup_limit_mib is not None else self.total_mib

    @property
    def headroom_mib(self) -> float:
        """What can still be allocated here: the machine's available memory, within the cgroup's limit."""
        if self.cgroup_limit_mib is None or self.cgroup_used_mib is None:
            return self.available_mib
        return min(self.available_mib, self.cgroup_limit_mib - self.cgroup_used_mib)

    def as_dict(self) -> dict:
        return {"total_mib": self.total_mib, "available_mib": self.headroom_mib,
                "cgroup_limit_mib": self.cgroup_limit_mib, "limit_mib": self.limit_mib}


def read_host_memory(cgroup: list[tuple[Path, Path]] | None = None) -> HostMemory:
    """`cgroup`: the (limit, usage) files of `cgroup_files()`, found once by a caller that reads many times."""
    vm = psutil.virtual_memory()
    limit, used = _cgroup_memory(cgroup_files() if cgroup is None else cgroup)
    return HostMemory(vm.total / MIB, vm.available / MIB, limit, used)


def _cgroup_dir(controller_file: str) -> Path | None:
    """This process's cgroup folder holding `controller_file` (v2 unified, else v1's memory controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and controller_file == "memory.max":                 # v2
            candidates = [CGROUP_ROOT / path.lstrip("/"), CGROUP_ROOT]
        elif "memory" in controllers.split(",") and controller_file != "memory.max":  # v1
            candidates = [CGROUP_ROOT / "memory" / path.lstrip("/"), CGROUP_ROOT / "memory"]
        else:
            continue
        # Inside a container the cgroup namespace puts this process's cgroup at the mount's root.
        for folder in candidates:
            if (folder / controller_file).is_file():
                return folder
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def cgroup_files() -> list[tuple[Path, Path]]:
    """The (limit, usage) files of this process's cgroup and of every one above it (a parent's limit binds its
    children), up to the hierarchy's root; [] where none can be read."""
    v2 = _cgroup_dir("memory.max")
    folder = v2 or _cgroup_dir("memory.limit_in_bytes")
    names = ("memory.max", "memory.current") if v2 is not None else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    files: list[tuple[Path, Path]] = []
    while folder is not None and (folder / names[0]).is_file():
        files.append((folder / names[0], folder / names[1]))
        folder = folder.parent if folder.parent != folder else None
    return files


def _cgroup_memory(files: list[tuple[Path, Path]]) -> tuple[float | None, float | None]:
    """(limit, usage) in MiB of the tightest limit among `files`; (None, None) when none is set."""
    tightest: tuple[int, int | None] | None = None
    for limit_file, usage_file in files:
        limit = _read_int(limit_file)
        if limit is not None and limit < _NO_LIMIT_BYTES and (tightest is None or limit < tightest[0]):
            tightest = (limit, _read_int(usage_file))
    if tightest is None:
        return None, None
    limit, used = tightest
    return limit / MIB, None if used is None else used / MIB


def cgroup_oom_kills() -> int | None:
    """How many processes of this cgroup the kernel's OOM killer has killed (None: not readable here)."""
    v2 = _cgroup_dir("memory.max")
    path = v2 / "memory.events" if v2 is not None else None
    if path is None:
        v1 = _cgroup_dir("memory.oom_control")
        path = v1 / "memory.oom_control" if v1 is not None else None
    try:
        text = path.read_text() if path is not None else ""
    except OSError:
        return None
    found = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def kernel_log_killed(pid: int) -> bool | None:
    """Whether the kernel's log says its OOM killer killed `pid` (None: the log cannot be read here)."""
    if in_child_pid_namespace():
        return None  # the log names processes by the host's pids: ours cannot be matched
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    # "Out of memory: Killed process 123 (python) ..." and "oom-kill:constraint=...,task=python,pid=123,uid=0"
    pattern = re.compile(rf"Killed process {pid} \(|oom-kill:.*[,:]pid={pid},")
    found = False
    try:
        while True:
            try:
                record = os.read(fd, 8192)  # one record per read
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while reading; go on with the next
                continue
            if not record:
                break
            if pattern.search(record.decode(errors="replace")):
                found = True
    finally:
        os.close(fd)
    return found


@dataclass(frozen=True)
class HostSample:
    t: float                 # time.monotonic()
    tree_rss_mib: float      # the watched processes, summed
    memory: HostMemory


def near_limit(samples: list[HostSample], budget_mib: float | None = None) -> dict | None:
    """The figures of the sample closest to running out when it came within the margin of a limit (headroom nearly
    gone, or the processes' RSS at the host's limit or at `budget_mib`, the job's memory); else None."""
    closest, closest_gap, why = None, None, ""
    for sample in samples:
        limit = sample.memory.limit_mib if budget_mib is None else min(sample.memory.limit_mib, budget_mib)
        against = f"plan.host_mib ({limit:,.0f} MiB)" if limit == budget_mib else f"the host's {limit:,.0f} MiB"
        gaps = [(sample.memory.headroom_mib, "host memory available"),
                (limit - sample.tree_rss_mib, f"the workers' RSS ({sample.tree_rss_mib:,.0f} MiB) against {against}")]
        gap, what = min(gaps)
        if gap <= max(MARGIN_MIB, MARGIN_FRACTION * limit) and (closest_gap is None or gap < closest_gap):
            closest, closest_gap, why = sample, gap, what
    if closest is None:
        return None
    return {**closest.memory.as_dict(), "tree_rss_mib": closest.tree_rss_mib, "budget_mib": budget_mib,
            "gap_mib": closest_gap, "near": why}


@dataclass(frozen=True)
class HostExit:
    """What the watch knows of one worker's end: the samples of its last seconds and the kernel's records."""

    samples: list[HostSample]
    cgroup_oom_kills: int | None     # OOM kills in this cgroup since the watch started (None: not readable)
    kernel_log: bool | None          # the kernel's log names the pid as OOM-killed (None: not readable)

    @property
    def kernel_says_oom(self) -> bool:
        return bool(self.cgroup_oom_kills) or bool(self.kernel_log)


class HostWatch(Periodic):
    """Samples host memory and the RSS of `root`'s descendants every `interval_s`, keeping the last `window_s`;
    when a process of the tree is gone, the window before it left is kept for `exit(pid)`."""

    MAX_EXITS = 64

    thread_name = "zerotune-host-watch"

    def __init__(self, root: int | None = None, interval_s: float = 0.1, window_s: float = 3.0,
                 skip_pids: frozenset[int] = frozenset()) -> None:
        super().__init__(interval_s)
        self._tree = ProcessTree(os.getpid() if root is None else root, include_root=False, skip_pids=skip_pids)
        self._recent: deque[HostSample] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        self._exits: dict[int, list[HostSample]] = {}
        self._alive: set[int] = set()
        self._lock = threading.Lock()
        self._oom_kills_at_start: int | None = None
        # Found once: finding them (/proc/self/cgroup, a stat a level) costs twice what reading them does.
        self._cgroup = cgroup_files()

    def start(self) -> Self:
        self._oom_kills_at_start = cgroup_oom_kills()
        return super().start()

    def sample_now(self) -> HostSample:
        pids = self._tree.pids()
        sample = HostSample(time.monotonic(), self._tree.rss_bytes(pids) / MIB, read_host_memory(self._cgroup))
        with self._lock:
            self._recent.append(sample)
            for gone in self._alive - set(pids):
                self._exits[gone] = list(self._recent)
            while len(self._exits) > self.MAX_EXITS:
                del self._exits[next(iter(self._exits))]
            self._alive = set(pids)
        return sample

    def exit(self, pid: int | None) -> HostExit:
        """The samples before `pid` left the tree (the latest ones if it was not seen leave), with the kernel's
        records of an OOM kill."""
        self.sample_now()  # a worker reaped since the last tick is seen gone
        with self._lock:
            samples = self._exits.get(pid) if pid is not None else None
            samples = list(samples if samples is not None else self._recent)
        now = cgroup_oom_kills()
        kills = None if now is None or self._oom_kills_at_start is None else now - self._oom_kills_at_start
        return HostExit(samples, kills, kernel_log_killed(pid) if pid is not None else None)

"""Locks a killed JIT build left in the torch extensions cache: torch's loader takes `<op>/lock` on every load and
every other loader spins with no time limit while it exists. The holder keeps it open, so a lock no live process
has open is provably stale; where not every possible holder is in view (a process that cannot be inspected, a
network file system), it is undecided and the user is told which file."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from filelock import FileLock, Timeout

from zerotune.host.ops_env import extensions_root
from zerotune.host.platform import fs_type

log = logging.getLogger("zerotune")

LOCK_NAME = "lock"  # torch's FileBaton(os.path.join(build_directory, 'lock'))
# The holder closes the file a moment before removing it: stale only if the same file is open nowhere this long
# after a first look found no holder.
CONFIRM_S = 0.2
# Jobs take turns at removing, so one's fresh lock is never taken by another for the stale file (flock).
CLEANUP_LOCK = ".zerotune-lock-cleanup"
# File systems shared between machines: a process holding a lock there may live on another host.
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph",
              "glusterfs", "fuse.glusterfs", "fuse.sshfs", "9p", "afs", "panfs", "wekafs", "virtiofs"}


@dataclass
class LockState:
    path: Path
    state: str                      # "gone" | "stale" | "held" | "undecided" | "removed"
    pids: list[int] = field(default_factory=list)  # its holders, when held
    reason: str = ""                # why it is undecided
    identity: tuple = ()            # (device, inode, mtime): a new lock at the same path is another file

    def describe(self) -> str:
        if self.state == "held":
            holders = ", ".join(_name(p) for p in self.pids) or "a process that just took it"
            return f"{self.path} is held by {holders}: a build (or load) in progress"
        if self.state == "undecided":
            return f"{self.path} may be stale: {self.reason}"
        if self.state == "stale":
            return f"{self.path} is stale: no process has it open (a JIT build was killed mid-way)"
        return f"{self.path} is {self.state}"


def lock_path(op: str, root: Path | None = None) -> Path:
    return (root or extensions_root()) / op / LOCK_NAME


def find_locks(root: Path | None = None, ops: list[str] | None = None) -> list[Path]:
    """The lock files present for `ops` (op names: cpu_adam, ...), or for every op folder under the root."""
    root = root or extensions_root()
    if ops is None:
        ops = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [lock for lock in (lock_path(op, root) for op in ops) if lock.is_file()]


def inspect(locks: list[Path]) -> list[LockState]:
    """Each lock's state; one found open nowhere is looked at again CONFIRM_S later before it is called stale."""
    first = _look(locks)
    suspects = [s.path for s in first if s.state == "stale"]
    if not suspects:
        return first
    time.sleep(CONFIRM_S)
    again = {s.path: s for s in _look(suspects)}
    return [s if s.state != "stale" else _confirmed(s, again[s.path]) for s in first]


def _confirmed(before: LockState, after: LockState) -> LockState:
    if after.state == "stale" and after.identity != before.identity:
        return LockState(after.path, "held", identity=after.identity)  # replaced meanwhile: a new build's
    return after


def remove_stale(state: LockState) -> LockState:
    """Delete a lock found stale, if it is still that very file, with a warning naming it."""
    if state.state != "stale":
        return state
    try:
        if _identity(state.path) != state.identity:
            return LockState(state.path, "held")  # another job removed it, and a new one was taken since
        state.path.unlink()
    except FileNotFoundError:
        return LockState(state.path, "gone")
    log.warning("removed the stale torch extensions lock %s: no process had it open (a JIT build was killed "
                "mid-way); left there, every DeepSpeed load of that op would wait on it forever", state.path)
    return LockState(state.path, "removed", identity=state.identity)


def settle(path: Path, timeout_s: float, poll_s: float = 1.0) -> LockState:
    """Remove the lock if it is stale; wait up to `timeout_s` while a live process holds it. The result is
    "gone" or "removed" (go on), or "held" / "undecided" (the caller stops, naming the file)."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        if not path.exists():
            state = LockState(path, "gone")  # the usual case: no lock, no cleanup turn needed
        else:
            with _cleanup_turn(path.parent.parent):
                state = remove_stale(inspect([path])[0])
        if state.state != "held" or time.monotonic() >= deadline:
            return state
        if not announced:
            log.info("waiting up to %.0f s: %s", timeout_s, state.describe())
            announced = True
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def _cleanup_turn(root: Path, timeout_s: float = 30.0) -> Iterator[None]:
    """This root's cleanup lock, for a bounded time; without it (read-only root, timeout) the removal's own
    same-file check still applies."""
    with contextlib.ExitStack() as held:
        with contextlib.suppress(OSError, Timeout):
            held.enter_context(FileLock(str(root / CLEANUP_LOCK), timeout=timeout_s))
        yield


def _identity(path: Path) -> tuple:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _look(locks: list[Path]) -> list[LockState]:
    """One pass over /proc: who has each lock open, and which processes could not be looked into."""
    found: dict[Path, tuple] = {}
    for lock in locks:
        with contextlib.suppress(FileNotFoundError):
            found[lock] = (_identity(lock), lock.stat().st_uid)
    holders, hidden = _scan({identity[:2] for identity, _ in found.values()})
    states = []
    for lock in locks:
        if lock not in found:
            states.append(LockState(lock, "gone"))
            continue
        identity, owner = found[lock]
        pids = sorted(holders.get(identity[:2], []))
        reason = "" if pids else _undecided_reason(lock, owner, hidden)
        state = "held" if pids else ("undecided" if reason else "stale")
        states.append(LockState(lock, state, pids, reason, identity))
    return states


def _scan(wanted: set[tuple[int, int]]) -> tuple[dict[tuple[int, int], list[int]], dict[int, int]]:
    """{(device, inode): pids that have it open}, and {pid: uid} of the processes that could not be read."""
    holders: dict[tuple[int, int], list[int]] = {}
    hidden: dict[int, int] = {}
    if not wanted or not os.path.isdir("/proc/self/fd"):
        return holders, hidden
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            hidden[pid] = _uid(pid)
            continue
        except OSError:
            continue  # it exited meanwhile
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:  # readlink is cheap; only files named like torch's lock are worth a stat through the link
                if os.path.basename(os.readlink(link)) != LOCK_NAME:
                    continue
                st = os.stat(link)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in wanted:
                holders.setdefault((st.st_dev, st.st_ino), []).append(pid)
    return holders, hidden


def _undecided_reason(lock: Path, owner: int, hidden: dict[int, int]) -> str:
    """Why a lock open nowhere in view might still be held; "" when the view is complete."""
    if not os.path.isdir("/proc/self/fd"):
        return "this system has no /proc to show which processes have it open"
    fs = fs_type(lock)
    if fs in NETWORK_FS:
        return f"it is on a {fs} file system, where a build on another machine may hold it"
    # Its holder created it, so runs as its owner: other users' processes cannot be holding it.
    blind = sorted(pid for pid, uid in hidden.items() if uid in (owner, -1))
    if blind:
        shown = ", ".join(map(str, blind[:5])) + (" ..." if len(blind) > 5 else "")
        return f"process(es) {shown} could not be inspected (permission denied)"
    return ""


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _name(pid: int) -> str:
    try:
        return f"pid {pid} ({' '.join(psutil.Process(pid).cmdline())[:120]})"
    except psutil.Error:
        return f"pid {pid}"

"""Walking process trees and folders cheaply, while they change under the walk (processes exit, swap
files come and go)."""

from __future__ import annotations

import os


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
    """A small /proc file in 3 syscalls. open() takes 7 (fstat, ioctl, lseek, a second read) and a buffer: the
    samplers read one file per thread of every watched process, 20 times a second in each of 3 samplers."""
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
    """What a child still running its parent's program (forked or vforked, not yet exec'd: the same command
    line) holds of its own, or None when it is not such a child (or /proc cannot say): its RSS counts its
    parent's pages again. A vforked child shares its parent's address space (the same statm): 0. A forked one
    shares its pages copy-on-write: its private pages (smaps_rollup). A subprocess started by a worker of
    800 MiB would otherwise add 800 MiB to the tree's sum for the moment before its exec."""
    mine = _read(f"/proc/{pid}/cmdline")
    if not mine or mine != _read(f"/proc/{ppid}/cmdline"):
        return None
    statm = _read(f"/proc/{pid}/statm")
    if statm is not None and statm == _read(f"/proc/{ppid}/statm"):
        return 0
    rollup = (_read(f"/proc/{pid}/smaps_rollup") or b"").decode(errors="replace")
    private = [int(line.split()[1]) for line in rollup.splitlines() if line.startswith(("Private_Clean:", "Private_Dirty:"))]
    return sum(private) * 1024 if private else None

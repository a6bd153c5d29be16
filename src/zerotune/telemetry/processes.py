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

"""Whether a folder can take a run's files, found out by doing what the run will do (create it, write a file in
it) and undoing it: a permission check alone passes for root on /proc or a read-only mount, where creating
still fails."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psutil


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a file included)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_probe(folder: Path) -> OSError | None:
    """Create `folder` if it is missing (its parent must exist), write a file in it, then undo both; the
    error met on the way, or None."""
    created = not folder.exists()
    try:
        if created:
            folder.mkdir()
        probe = folder / f".zerotune-write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
        return None
    except OSError as exc:
        return exc
    finally:
        if created and folder.is_dir():
            folder.rmdir()


def mount_of(path: Path) -> psutil._common.sdiskpart | None:
    """The mount holding `path` (the longest mount point above it); None where none is found."""
    real = os.path.realpath(path)
    try:
        mounts = [m for m in psutil.disk_partitions(all=True)
                  if os.path.commonpath([real, m.mountpoint]) == m.mountpoint]
    except (OSError, ValueError):
        return None
    return max(mounts, key=lambda m: len(m.mountpoint)) if mounts else None


def fs_type(path: Path) -> str:
    """The type of the file system holding `path` (ext4, nfs4, tmpfs, ...); "" where unknown."""
    mount = mount_of(path)
    return mount.fstype if mount else ""


def file_system(path: Path) -> str:
    """The file system holding `path`, in words: "a proc file system", "a tmpfs file system, mounted read-only"."""
    mount = mount_of(path)
    if mount is None:
        return "an unknown file system"
    read_only = ", mounted read-only" if "ro" in mount.opts.split(",") else ""
    return f"a {mount.fstype} file system{read_only}"

"""Disk space for a save: checked before it starts, and named plainly when a save runs out of it."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from zerotune.checkpoints.layout import folder_bytes, latest
from zerotune.units import MIB

_MARGIN = 1.05  # sizes vary a little from save to save (pickled RNG states, metadata)
_FULL_BELOW = 16 * MIB  # free space this low after a failed write: the disk filled up


class CheckpointSpaceError(OSError):
    """Not enough free space for a checkpoint, before or during its save."""

    def __init__(self, root: Path, needed: int, free: int, basis: str, during: bool = False):
        self.root, self.needed, self.free = Path(root), needed, free
        when = "ran out of space while saving" if during else "has too little space for the next checkpoint"
        super().__init__(errno.ENOSPC, f"{root} {when}: it needs about {needed / MIB:.1f} MiB ({basis}), "
                         f"{free / MIB:.1f} MiB are free. Fix: free space there, or checkpoint.dir=<a larger "
                         "disk>, or a smaller checkpoint.keep_last")

    def __str__(self) -> str:
        return str(self.strerror)  # the sentence, without OSError's "[Errno 28]" in front


def free_bytes(path: Path) -> int:
    """Free space of the file system holding `path` (its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def estimate(root: Path, fallback: int) -> tuple[int, str]:
    """Bytes the next save needs: the previous complete save's size, else `fallback` (from the model)."""
    previous = latest(root)
    if previous is not None:
        return folder_bytes(previous), f"the size of {previous.name}"
    return fallback, "estimated from the model: fp32 weights and two optimizer moments"


def check_room(root: Path, fallback: int) -> None:
    needed, basis = estimate(root, fallback)
    free = free_bytes(root)
    if free < needed * _MARGIN:
        raise CheckpointSpaceError(root, needed, free, basis)


def is_disk_full(exc: BaseException, root: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC anywhere in its chain, or (torch's zip writer reports
    ENOSPC as 'unexpected pos') a file system left nearly empty of free space."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes(root) < _FULL_BELOW

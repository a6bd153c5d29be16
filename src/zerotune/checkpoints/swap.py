"""DeepSpeed's NVMe swap folders left behind by a killed run, removed before a resumed run swaps again."""

from __future__ import annotations

import shutil
from pathlib import Path


def clean_stale_swap(root: str | Path) -> list[str]:
    """Remove DeepSpeed's swap folders (zero_stage_*) directly inside `root`, and nothing outside it.

    A symlink among them is unlinked, never followed; shutil.rmtree does not follow links inside.
    """
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        return []
    real_root, removed = root.resolve(), []
    for entry in root.iterdir():
        if not entry.name.startswith("zero_stage_"):
            continue
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink()
        elif entry.resolve().parent == real_root:
            shutil.rmtree(entry)
        else:
            continue
        removed.append(str(entry))
    return removed

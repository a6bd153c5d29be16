"""Writing a file so that a reader, or a crash, never sees half of it: write a temporary file beside it,
then rename it over the target (a rename within one folder is atomic on POSIX file systems)."""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replaced(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path (unique to this process) to write; on success it becomes `path`. `durable`:
    fsync before the rename, for files that must survive a power cut (checkpoint markers)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str, durable: bool = False) -> None:
    with replaced(path, durable) as tmp:
        tmp.write_text(text)


def jsonable(value: Any) -> Any:
    """JSON has no NaN/inf: a diverged loss is recorded as null (and flagged by the run's status). An enum (a run's
    Status) is its value, as every reader of the JSON (W&B's summary too) should see it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json_atomic(path: str | Path, data: Any, durable: bool = False) -> None:
    write_text_atomic(path, json.dumps(jsonable(data), indent=2) + "\n", durable)


def cache_dir(kind: str) -> Path:
    """zerotune's own cache (model counts, planner traces): $ZEROTUNE_CACHE_DIR or ~/.cache/zerotune."""
    return Path(os.environ.get("ZEROTUNE_CACHE_DIR", Path.home() / ".cache" / "zerotune")) / kind


def read_json(path: Path) -> Any | None:
    """A JSON file's content, or None when it is absent or unreadable (a partial write from a killed process)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_cached_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)  # a concurrent reader sees the whole entry or none

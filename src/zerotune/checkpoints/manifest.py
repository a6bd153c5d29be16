"""COMPLETE, the marker written last into a checkpoint: the size and sha256 of every file in it.

Resume checks a checkpoint against it before loading, so a truncated or altered file is named up
front instead of failing deep inside torch.load a minute later. Checkpoints written before the
manifest existed hold only the step number in COMPLETE; they are checked for readable metadata only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TypedDict

from zerotune.checkpoints.layout import COMPLETE, META, read_meta


class FileRecord(TypedDict):
    bytes: int
    sha256: str


class Manifest(TypedDict):
    """COMPLETE's JSON: the step saved, and each file's record by its path inside the checkpoint."""

    step: int
    files: dict[str, FileRecord]


def file_record(path: Path, durable: bool = False) -> FileRecord:
    """Size and sha256 of one file (fsynced first when `durable`: the save is published after this)."""
    with open(path, "rb") as fh:
        if durable:
            os.fsync(fh.fileno())
        digest = hashlib.file_digest(fh, "sha256")
    return FileRecord(bytes=Path(path).stat().st_size, sha256=digest.hexdigest())


def build(folder: Path, step: int, durable: bool = True) -> Manifest:
    """The manifest of everything under `folder` (COMPLETE itself excluded)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE)
    return Manifest(step=step, files={p.relative_to(folder).as_posix(): file_record(p, durable) for p in files})


def dumps(manifest: Manifest) -> str:
    return json.dumps(manifest, indent=1) + "\n"


def read(folder: Path) -> dict | None:
    """The manifest in `folder`/COMPLETE, or None for a checkpoint that predates manifests."""
    text = (Path(folder) / COMPLETE).read_text()
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) and "files" in found else None


def problems(folder: Path) -> list[str]:
    """What is wrong with checkpoint `folder`, file by file; [] when every file matches its record."""
    folder = Path(folder)
    try:
        manifest = read(folder)
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{COMPLETE}: unreadable ({exc})"]
    if manifest is None:  # a checkpoint from before manifests: readable metadata is all it can show
        try:
            read_meta(folder)
        except (OSError, ValueError) as exc:
            return [f"{META}: unreadable ({exc})"]
        return []
    found = []
    for name, want in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            found.append(f"{name}: missing")
        elif path.stat().st_size != want["bytes"]:
            found.append(f"{name}: {path.stat().st_size} bytes, {want['bytes']} when saved (truncated or rewritten)")
        elif file_record(path)["sha256"] != want["sha256"]:
            found.append(f"{name}: sha256 differs from the one recorded when saved (the file was altered)")
    return found

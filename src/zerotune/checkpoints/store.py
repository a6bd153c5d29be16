"""Saving a checkpoint: every rank's state into a job-private temporary folder, published whole.

Crash safety: every rank writes into `.tmp-step-NNNNNNN-<job>/`; after a barrier rank 0 renames it to
`step-NNNNNNN/`, then writes COMPLETE (the manifest: each file's size and sha256) and the `latest`
pointer, each by write-then-rename. A process killed at any moment leaves either the previous complete
checkpoint or the new one. A save that runs out of disk space removes its partial folder and says so.
The folder layout and the rules for finding checkpoints: layout.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch

from zerotune.checkpoints import manifest, space
from zerotune.checkpoints.layout import (
    COMPLETE,
    EMA_FILE,
    LATEST,
    META,
    TMP_PREFIX,
    is_step_dir,
    list_complete,
    step_dir,
    tmp_dir,
)
from zerotune.files import write_text_atomic
from zerotune.pause_hook import pause


@dataclass
class SaveRequest:
    """What one save writes, besides accelerate's own state: given by the trainer, explicitly."""

    root: Path
    step: int
    meta: dict
    position_state: dict          # this rank's data position and generators
    unet: Any                     # the unwrapped U-Net (its config is saved)
    encoder_configs: dict[str, Any] = field(default_factory=dict)  # trained text encoders' configs: <name>/config.json
    job: str = "job"              # names the temporary folder: two jobs never share one
    size_estimate: int = 0        # bytes, for the first save's space check (later ones use the previous save)
    ema_state: dict | None = None
    keep_last: int = 0


class SavedCheckpoint(TypedDict):
    """A save as summary.json's checkpoints list records it (with its step)."""

    path: str       # the published checkpoint folder
    seconds: float  # the save's wall time, on this rank
    bytes: int      # what rank 0 published (0 on the other ranks)


def save(acc, request: SaveRequest) -> SavedCheckpoint:
    """Save on EVERY rank (a rank-0-only save hangs under DeepSpeed)."""
    t0 = time.perf_counter()
    final, tmp = step_dir(request.root, request.step), tmp_dir(request.root, request.step, request.job)
    if acc.is_main_process:
        request.root.mkdir(parents=True, exist_ok=True)
        space.check_room(request.root, request.size_estimate)  # before a byte is written
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    try:
        acc.save_state(str(tmp))
        torch.save(request.position_state, tmp / f"trainer_state_{acc.process_index}.pt")
        if acc.is_main_process:
            if request.ema_state is not None:
                torch.save(request.ema_state, tmp / EMA_FILE)
            request.unet.save_config(tmp)
            for name, config in request.encoder_configs.items():  # what export rebuilds each encoder from
                config.save_pretrained(tmp / name)
            (tmp / META).write_text(json.dumps({**request.meta, "step": request.step}, indent=2))
    except Exception as exc:
        raise _failed_save(exc, tmp, request) from exc
    pause(f"save-{request.step}")
    acc.wait_for_everyone()
    size = _publish(tmp, final, request) if acc.is_main_process else 0
    acc.wait_for_everyone()
    return SavedCheckpoint(path=str(final), seconds=time.perf_counter() - t0, bytes=size)


def _failed_save(exc: Exception, tmp: Path, request: SaveRequest) -> Exception:
    """The partial save goes (it would hold the disk full); a full disk is said in plain words."""
    written = space.folder_bytes(tmp) if tmp.is_dir() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    if not space.is_disk_full(exc, request.root):
        return exc
    needed, basis = space.estimate(request.root, request.size_estimate)
    return space.CheckpointSpaceError(request.root, max(needed, written), space.free_bytes(request.root),
                                      f"{basis}; {written / space.MIB:.1f} MiB were written before it failed",
                                      during=True)


def _publish(tmp: Path, final: Path, request: SaveRequest) -> int:
    """Rank 0: make the written folder the checkpoint, durably, then mark it complete with its manifest."""
    record = manifest.build(tmp, request.step, durable=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(final / COMPLETE, manifest.dumps(record), durable=True)
    write_text_atomic(Path(request.root) / LATEST, final.name + "\n", durable=True)
    cleanup(request.root, request.keep_last, keep=final)
    return sum(f["bytes"] for f in record["files"].values())


def cleanup(root: Path, keep_last: int, keep: Path | None = None) -> None:
    """Delete interrupted saves and all but the newest `keep_last` complete checkpoints (0 keeps all).
    `keep`, the save just published, is never deleted: in a checkpoint dir that holds later steps of an
    earlier run it is not among the newest, yet it is this run's (its final one, perhaps).
    Only the job holding the checkpoint dir's lock saves, so every temporary folder here is stale or its own."""
    root = Path(root)
    done = set(list_complete(root))
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX) or (is_step_dir(p) and p not in done):
            shutil.rmtree(p, ignore_errors=True)
    ordered = list_complete(root)
    for p in ordered[:-keep_last] if keep_last > 0 else []:
        if keep is not None and p == Path(keep):
            continue
        (p / COMPLETE).unlink()  # incomplete first, so a crash mid-delete leaves no half checkpoint marked done
        shutil.rmtree(p, ignore_errors=True)

"""Checkpoint folders on disk: the layout, crash-safe saving, finding complete ones, keeping the last N.

One checkpoint, `<checkpoint.dir>/step-NNNNNNN/`:

    pytorch_model/            DeepSpeed's own checkpoint (model, optimizer partitions, scheduler), or
    model.safetensors ...     accelerate's files on the plain (no DeepSpeed) path
    random_states_<rank>.pkl  torch / numpy / python RNG of each rank (accelerate)
    trainer_state_<rank>.pt   step, data position, the Trainer's own generators
    ema.pt                    the host EMA (rank 0), when enabled
    config.json               the U-Net's architecture (diffusers' save_config), for export
    meta.json                 zero stage, world size, use_deepspeed, precision, offload, model, version
    COMPLETE                  written last: a folder without it is ignored

Crash safety: every rank writes into `.tmp-step-NNNNNNN/`; after a barrier rank 0 renames it to
`step-NNNNNNN/`, then writes COMPLETE and the `latest` pointer (each by write-then-rename).
A process killed at any moment leaves either the previous complete checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotune.errors import ConfigError
from zerotune.files import write_text_atomic

COMPLETE, META, LATEST, EMA_FILE = "COMPLETE", "meta.json", "latest", "ema.pt"
UNET_CONFIG = "config.json"            # diffusers' CONFIG_NAME, written by save_config
OLD_UNET_CONFIG = "unet_config.json"   # what earlier checkpoints hold
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / COMPLETE).is_file() and (path / META).is_file()


def list_complete(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (scanned: the `latest` file is a convenience only)."""
    done = list_complete(root)
    return done[-1] if done else None


def find(path: Path) -> Path | None:
    """`path` itself if it is a complete checkpoint, else the newest in it or in its checkpoints/."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        found = latest(root)
        if found is not None:
            return found
    return None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def unet_config(path: Path) -> dict:
    old = Path(path) / OLD_UNET_CONFIG
    return json.loads((old if old.is_file() else Path(path) / UNET_CONFIG).read_text())


def checkpoint_root(configured: Any, run_dir: Path | None) -> Path:
    """`checkpoint.dir`, or <run dir>/checkpoints."""
    if configured:
        return Path(str(configured)).expanduser()
    if run_dir is None:
        raise ConfigError("checkpoint.dir", "no run directory to put checkpoints in", "checkpoint.dir=/some/folder")
    return Path(run_dir) / "checkpoints"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


@dataclass
class SaveRequest:
    """What one save writes, besides accelerate's own state: given by the trainer, explicitly."""

    root: Path
    step: int
    meta: dict
    position_state: dict          # this rank's data position and generators
    unet: Any                     # the unwrapped U-Net (its config is saved)
    ema_state: dict | None = None
    keep_last: int = 0


def save(acc, request: SaveRequest) -> dict:
    """Save on EVERY rank (a rank-0-only save hangs under DeepSpeed); returns {path, seconds, bytes}."""
    t0 = time.perf_counter()
    final = step_dir(request.root, request.step)
    tmp = final.with_name(f".tmp-{final.name}")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    torch.save(request.position_state, tmp / f"trainer_state_{acc.process_index}.pt")
    if acc.is_main_process:
        _write_rank0_files(tmp, request)
    acc.wait_for_everyone()
    size = _publish(tmp, final, request) if acc.is_main_process else 0
    acc.wait_for_everyone()
    return {"path": str(final), "seconds": time.perf_counter() - t0, "bytes": size}


def _write_rank0_files(tmp: Path, request: SaveRequest) -> None:
    if request.ema_state is not None:
        torch.save(request.ema_state, tmp / EMA_FILE)
    request.unet.save_config(tmp)
    (tmp / META).write_text(json.dumps({**request.meta, "step": request.step}, indent=2))


def _publish(tmp: Path, final: Path, request: SaveRequest) -> int:
    """Rank 0: make the written folder the checkpoint, durably, then mark it complete."""
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(final / COMPLETE, f"{request.step}\n", durable=True)
    write_text_atomic(Path(request.root) / LATEST, final.name + "\n", durable=True)
    cleanup(request.root, request.keep_last)
    return folder_bytes(final)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())


def cleanup(root: Path, keep_last: int) -> None:
    """Delete interrupted saves and all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    root = Path(root)
    for p in root.iterdir():
        if p.name.startswith(".tmp-step-") or (_STEP_RE.match(p.name) and not is_complete(p)):
            shutil.rmtree(p, ignore_errors=True)
    done = list_complete(root)
    for p in done[:-keep_last] if keep_last > 0 else []:
        (p / COMPLETE).unlink()  # incomplete first, so a crash mid-delete leaves no half checkpoint marked done
        shutil.rmtree(p, ignore_errors=True)

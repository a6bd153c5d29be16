"""Checkpoint folders on disk: their names, which ones are complete, and finding them.

One checkpoint, `<checkpoint.dir>/step-NNNNNNN/`:

    pytorch_model/            DeepSpeed's own checkpoint (model, optimizer partitions, scheduler), or
    model.safetensors ...     accelerate's files on the plain (no DeepSpeed) path
    random_states_<rank>.pkl  torch / numpy / python RNG of each rank (accelerate)
    trainer_state_<rank>.pt   step, data position, the Trainer's own generators
    ema.pt                    the host EMA (rank 0), when enabled
    config.json               the U-Net's architecture (diffusers' save_config), for export
    meta.json                 zero stage, world size, use_deepspeed, precision, offload, model, version
    COMPLETE                  written last: every file's size and sha256 (manifest.py); a folder
                              without it is ignored

Saves are written into `.tmp-step-NNNNNNN-<job>/` and renamed when whole (checkpoints/store.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from zerotune.errors import ConfigError

COMPLETE, META, LATEST, EMA_FILE = "COMPLETE", "meta.json", "latest", "ema.pt"
UNET_CONFIG = "config.json"            # diffusers' CONFIG_NAME, written by save_config
OLD_UNET_CONFIG = "unet_config.json"   # what earlier checkpoints hold
TMP_PREFIX = ".tmp-step-"
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def tmp_dir(root: Path, step: int, job: str) -> Path:
    """Where one job writes a save before it is complete: unique per job, shared by its ranks."""
    return Path(root) / f"{TMP_PREFIX}{step:07d}-{job}"


def job_token(run_dir: Path) -> str:
    """A job's name in its temporary folders: from its run dir, so all its ranks agree without talking."""
    return hashlib.sha1(str(Path(run_dir).absolute()).encode()).hexdigest()[:10]


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / COMPLETE).is_file() and (path / META).is_file()


def is_step_dir(path: Path) -> bool:
    return bool(_STEP_RE.match(Path(path).name))


def list_complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (scanned: the `latest` file is a convenience only)."""
    done = list_complete(root)
    return done[-1] if done else None


def checkpoint_roots(path: Path) -> list[Path]:
    """The folders a `resume=<path>` may name checkpoints in: the path, and its checkpoints/ (a run dir)."""
    return [Path(path), Path(path) / "checkpoints"]


def find(path: Path) -> Path | None:
    """`path` itself if it is a complete checkpoint, else the newest in it or in its checkpoints/."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in checkpoint_roots(path):
        found = latest(root)
        if found is not None:
            return found
    return None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def unet_config(path: Path) -> dict:
    old = Path(path) / OLD_UNET_CONFIG
    return json.loads((old if old.is_file() else Path(path) / UNET_CONFIG).read_text())


def checkpoint_root(configured: str | None, run_dir: Path | None) -> Path:
    """`checkpoint.dir`, or <run dir>/checkpoints."""
    if configured:
        return Path(str(configured)).expanduser()
    if run_dir is None:
        raise ConfigError("checkpoint.dir", "no run directory to put checkpoints in", "checkpoint.dir=/some/folder")
    return Path(run_dir) / "checkpoints"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())

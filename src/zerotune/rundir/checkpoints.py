"""Checkpoint folders, without torch: their layout, the manifest COMPLETE holds, which one `resume` names, disk space.

`<checkpoint.dir>/step-NNNNNNN/` holds pytorch_model/ (DeepSpeed's checkpoint) or accelerate's files (plain path),
random_states_<rank>.pkl, trainer_state_<rank>.pt (step, data position, generators), ema.pt (rank 0), config.json
(the U-Net's, for export), meta.json (stage, world size, precision, offload, model, version) and COMPLETE, written
last: every file's size and sha256 (older checkpoints: the step only). A folder without COMPLETE is ignored."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TypedDict

from zerotune.config.errors import ConfigError
from zerotune.config.schema import MIB, Resume

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


log = logging.getLogger(__name__)


def resolve_resume(resume: Resume, checkpoint_dir: str | None, run_dir: Path | None) -> Path | None:
    """The checkpoint folder `resume` names, or None: a checkpoint, a folder of them or a run dir (its newest),
    `latest` (the newest in checkpoint.dir), or `auto` (the same, or None when there is none)."""
    setting = resume.path
    if setting in (None, "", False):
        return None
    if str(setting) in ("latest", "auto"):
        root = checkpoint_root(checkpoint_dir, run_dir)
        candidates = list_complete(root)[::-1]
        if not candidates and str(setting) == "auto":
            return None  # a first start: nothing to continue yet (a requeued job finds its checkpoints)
        if not candidates:
            raise ConfigError("resume.path", f"resume=latest found no complete checkpoint in {root}", _latest_fix(
                checkpoint_dir))
        return first_sound(candidates, bool(resume.strict))
    path = Path(str(setting)).expanduser()
    if is_complete(path):
        return first_sound([path], True)  # named exactly: never swapped for another one
    if is_step_dir(path) and path.is_dir():
        raise ConfigError("resume.path", f"{path} has no COMPLETE marker: its save was interrupted",
                          f"resume={path.parent} (the newest complete checkpoint in it)")
    for root in checkpoint_roots(path):
        candidates = list_complete(root)[::-1]
        if candidates:
            return first_sound(candidates, bool(resume.strict))
    raise ConfigError("resume.path", f"{path} is not a complete checkpoint and holds none (an interrupted save "
                      "leaves no COMPLETE marker and is ignored)",
                      "resume=<run dir>, resume=<run dir>/checkpoints/step-NNNNNNN, or resume=latest")


def _latest_fix(checkpoint_dir: str | None) -> str:
    if checkpoint_dir:
        return "point checkpoint.dir at a folder holding step-NNNNNNN/ checkpoints, or resume=null"
    return ("run in the old run dir (hydra.run.dir=<old run dir>), or resume=<old run dir>, or "
            "checkpoint.dir=<old run dir>/checkpoints")


def first_sound(candidates: list[Path], strict: bool) -> Path:
    """The first of `candidates` (newest first) matching its manifest; a damaged one is skipped with a warning,
    or under `strict` stops with the fix."""
    for folder in candidates:
        found = problems(folder)
        if not found:
            return folder
        detail = "; ".join(found[:3]) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
        if strict:
            older = [p for p in list_complete(folder.parent) if p.name < folder.name]
            fix = (f"resume={older[-1]} (the previous complete checkpoint), or resume.strict=false with "
                   f"resume={folder.parent} to fall back automatically" if older
                   else "start anew with resume=null")
            raise ConfigError("resume.path", f"checkpoint {folder} is damaged: {detail}", fix)
        log.warning("checkpoint %s is damaged (%s): resuming from the previous complete one instead",
                    folder, detail)
    raise ConfigError("resume.path", f"every complete checkpoint in {candidates[0].parent} is damaged",
                      "resume=null to start anew, or point resume at a copy of the checkpoints")


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
    """Whether a failed save ran out of space: ENOSPC in its chain, or a nearly full file system (torch's zip
    writer reports ENOSPC as 'unexpected pos')."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes(root) < _FULL_BELOW

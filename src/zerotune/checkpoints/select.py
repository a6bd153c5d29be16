"""Which checkpoint `resume` names: found, checked against its manifest, and an earlier one when it is damaged."""

from __future__ import annotations

import logging
from pathlib import Path

from zerotune.checkpoints import manifest
from zerotune.checkpoints.layout import (
    checkpoint_root,
    checkpoint_roots,
    is_complete,
    is_step_dir,
    list_complete,
)
from zerotune.errors import ConfigError
from zerotune.schema import Resume

log = logging.getLogger(__name__)


def resolve_resume(resume: Resume, checkpoint_dir: str | None, run_dir: Path | None) -> Path | None:
    """The checkpoint folder `resume` (resume.path, resume.strict) names, or None. The rule (conf/config.yaml):
    a checkpoint folder, a folder of them or a run dir (its newest), `latest` (the newest in checkpoint.dir,
    default <run dir>/checkpoints), or `auto` (the same, or a fresh start when there is none)."""
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
    """The first of `candidates` (newest first) whose files match their manifest. A damaged one is skipped
    with a warning naming the file, unless `strict`, which stops with the fix."""
    for folder in candidates:
        found = manifest.problems(folder)
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

"""What the page may read and write: the working directory's multirun/ and outputs/ (where Hydra puts runs)
and the user's experiment folder (config_search), nothing else. Every path a request names is resolved
(symlinks included) and must stay inside one of them; so must the run and sweep folders an experiment saved
from the page names (allowed.py)."""

from __future__ import annotations

import os
from pathlib import Path

from zerotune.errors import ConfigError

RESULT_ROOTS = ("multirun", "outputs")
PICK_A_SWEEP = "pick a sweep from the list, e.g. multirun/<date>/<time>"


def project() -> Path:
    """The working directory: `zerotune train` run here writes its outputs/ and multirun/ here."""
    return Path.cwd()


def imports_dir() -> Path:
    return project() / "outputs" / "builder-imports"


def inside_results(relative: str, key: str = "folder", fix: str = PICK_A_SWEEP) -> Path:
    """`relative` (as the page shows it, e.g. multirun/2026-11-25/10-00-00) inside multirun/ or outputs/."""
    if not isinstance(relative, str) or not relative or "\x00" in relative or Path(relative).is_absolute():
        raise ConfigError(key, f"{relative!r} is not a folder under {' or '.join(RESULT_ROOTS)}/", fix)
    path = (project() / relative).resolve()
    for root in RESULT_ROOTS:
        base = (project() / root).resolve()
        if path == base or base in path.parents:
            return path
    raise ConfigError(key, f"{relative!r} is outside the project's {' and '.join(RESULT_ROOTS)} folders", fix)


def inside_sweep(relative: str, key: str, fix: str) -> None:
    """A job's folder named relative to its sweep's (hydra.sweep.subdir): it may not climb out of it."""
    if "\x00" in relative or Path(relative).is_absolute() or Path(os.path.normpath(relative)).parts[:1] == ("..",):
        raise ConfigError(key, f"{relative!r} is not a folder inside the sweep's folder", fix)


def shown(path: Path) -> str:
    """A path as the page shows it: relative to the project."""
    return str(path.resolve().relative_to(project().resolve()))

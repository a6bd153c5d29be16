"""What the page may read and write: the working directory's multirun/ and outputs/ (where Hydra puts runs)
and the user's experiment folder (config_search), nothing else. Every path a request names is resolved
(symlinks included) and must stay inside one of them."""

from __future__ import annotations

from pathlib import Path

from zerotune.errors import ConfigError

RESULT_ROOTS = ("multirun", "outputs")


def project() -> Path:
    """The working directory: `zerotune train` run here writes its outputs/ and multirun/ here."""
    return Path.cwd()


def imports_dir() -> Path:
    return project() / "outputs" / "builder-imports"


def inside_results(relative: str, key: str = "folder") -> Path:
    """`relative` (as the page shows it, e.g. multirun/2026-11-25/10-00-00) inside multirun/ or outputs/."""
    if not isinstance(relative, str) or not relative or "\x00" in relative or Path(relative).is_absolute():
        raise ConfigError(key, f"{relative!r} is not a folder under {' or '.join(RESULT_ROOTS)}/",
                          "pick a sweep from the list, e.g. multirun/<date>/<time>")
    path = (project() / relative).resolve()
    for root in RESULT_ROOTS:
        base = (project() / root).resolve()
        if path == base or base in path.parents:
            return path
    raise ConfigError(key, f"{relative!r} is outside the project's {' and '.join(RESULT_ROOTS)} folders",
                      "pick a sweep from the list, e.g. multirun/<date>/<time>")


def shown(path: Path) -> str:
    """A path as the page shows it: relative to the project."""
    return str(path.resolve().relative_to(project().resolve()))

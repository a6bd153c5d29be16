"""The builder page as an installed user runs it: in a working directory of theirs (a test's temporary
folder), with no config folder chosen; and the package's own config folders, which no save may touch."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerotune.config import search as config_search

PACKAGED_EXPERIMENTS = config_search.packaged_folder(config_search.PACKAGED_EXPERIMENTS) / "experiment"


def run_in(mp: pytest.MonkeyPatch, cwd: Path) -> Path:
    """Work in `cwd`, with the user's folder looked for afresh (config_search keeps the last choice)."""
    mp.chdir(cwd)
    mp.setattr(config_search, "_chosen", None)
    # Set, then removed: a monkeypatch records a variable only when it exists, and choose(DIR) sets it.
    mp.setenv(config_search.CONFIG_DIR_ENV, "")
    mp.delenv(config_search.CONFIG_DIR_ENV)
    return cwd


def with_multirun_readme(cwd: Path) -> Path:
    """A file the page may serve (multirun/README.md, as a checkout has one) in `cwd`."""
    (cwd / "multirun").mkdir(exist_ok=True)
    (cwd / "multirun" / "README.md").write_text("# Sweeps\n")
    return cwd


def snapshot(*folders: Path) -> list[tuple[str, int, bytes]]:
    """Every file below `folders` (the folders' own links followed), with its modification time and content;
    not Python's bytecode caches, which an import may write."""
    files = [p for folder in folders for p in Path(folder).resolve().rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    return sorted((str(p), p.stat().st_mtime_ns, p.read_bytes()) for p in files)


def packaged_configs() -> list[tuple[str, int, bytes]]:
    return snapshot(config_search.packaged_conf(), PACKAGED_EXPERIMENTS)

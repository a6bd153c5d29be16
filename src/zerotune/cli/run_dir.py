"""The run (or sweep) folder is checked before Hydra creates anything in it: a path through an existing file,
a folder this user cannot write, or a disk without room is a config error naming `hydra.run.dir` (or
`hydra.sweep.dir`), with a folder that does work as the fix.

It runs as a Hydra callback (conf/hydra/default.yaml), because Hydra calls `on_run_start` and
`on_multirun_start` after composing and before its own mkdir. Hydra turns an exception raised by a callback
into a warning and carries on, so the refusal ends the process itself (exit 2), as every config error does.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from zerotune.errors import ConfigError, exit_config_error
from zerotune.folders import file_system, nearest_existing, write_probe

# What a run's own records need (config, logs, metrics, summary); checkpoints check their own room.
MIN_FREE_BYTES = 16 * 2**20


class RunDirCheck(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit("hydra.sweep.dir", config.hydra.sweep.dir)


def _check_or_exit(key: str, folder: str) -> None:
    try:
        check_run_dir(key, folder)
    except ConfigError as exc:
        exit_config_error(exc)


def check_run_dir(key: str, folder: str) -> None:
    """A ConfigError naming `key` unless `folder` exists as a writable folder, or can be created as one, on a
    disk with MIN_FREE_BYTES free."""
    problem = problem_with(Path(folder))
    if problem:
        raise ConfigError(key, problem, _fix(key, Path(folder)))


def problem_with(folder: Path) -> str | None:
    existing = nearest_existing(folder)
    if not existing.is_dir():
        if existing == folder.absolute():
            return f"{folder} is an existing file, not a folder"
        return f"{existing} is a file, so {folder} cannot be created under it"
    exc = write_probe(existing)
    if exc is not None:
        return f"no file can be created in {existing}: {exc.strerror} ({existing} is on {file_system(existing)})"
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        return f"the disk holding {existing} has {free / 2**20:.1f} MiB free; a run needs {MIN_FREE_BYTES // 2**20} MiB"
    return None


def _fix(key: str, folder: Path) -> str:
    """The first of a few nearby folders that passes the same check, as the override to type."""
    absolute = folder.absolute()
    home = "multirun" if key == "hydra.sweep.dir" else "outputs"  # where Hydra puts them by default
    candidates = [absolute.with_name(absolute.name + "-run"), Path.cwd() / home / absolute.name,
                  Path(tempfile.gettempdir()) / "zerotune" / absolute.name]
    for candidate in candidates:
        if problem_with(candidate) is None:
            return f"{key}={candidate}"
    return f"{key}=<a folder you can write, on a disk with room>"

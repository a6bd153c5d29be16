"""Experiment files (<the user's folder>/experiment/<name>.yaml), written from overrides: what
`zerotune train experiment=<name>` then runs, holding only what differs from the default job.
Group choices become the file's defaults list (`override /zero_stage: "3"`), other keys nested values."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from zerotune import config_search
from zerotune.compose import parse_typed
from zerotune.errors import ConfigError

# A file name in one folder: no separators, no leading dot or dash, nothing a shell or Hydra must quote.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def experiment_path(name: str, key: str = "name") -> Path:
    """Where experiment `name` is written: the user's experiment/ folder (./zerotune/experiment/ unless
    --config-dir names another), for a name that cannot leave that folder. A packaged experiment's name is
    refused: the new file would hide it."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(key, f"{name!r} is not an experiment name: letters, digits, _ and - only (at most "
                          "64, starting with a letter or digit), no path separators or dots",
                          "e.g. my_zero3_cpu")
    search = config_search.current()
    path = search.experiments_folder() / f"{name}.yaml"
    found = search.option_file("experiment", name)
    if found is not None and found != path:
        raise ConfigError(key, f"{name!r} is a packaged experiment ({found}); a file of yours would hide it",
                          f"choose another name, e.g. my_{name}")
    return path


def experiment_file(name: str) -> Path | None:
    """The file `experiment=<name>` reads (the user's, else a packaged one), or None."""
    return config_search.current().option_file("experiment", name) if NAME.fullmatch(str(name)) else None


def experiment_names() -> list[str]:
    return config_search.current().group_options().get("experiment", [])


def write_experiment(path: Path, text: str) -> None:
    """Whole or not at all (a reader never sees half a file), creating the user's folder on first use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def experiment_yaml(overrides: list[str], comments: Sequence[str] = ()) -> str:
    groups = set(config_search.current().group_options()) - {"experiment"}
    choices: list[dict] = []
    values: dict = {}
    for arg in overrides:
        parsed = parse_typed(arg)
        key, value = parsed.key_or_group, parsed.value()
        if key in groups:
            choices.append({f"override /{key}": str(value)})
            continue
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    body = ({"defaults": choices} if choices else {}) | values
    head = ["# @package _global_", *(f"# {line}" for line in comments)]
    return "\n".join(head) + "\n" + (yaml.safe_dump(body, sort_keys=False) if body else "{}\n")

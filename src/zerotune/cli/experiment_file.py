"""Experiment files (experiments/experiment/<name>.yaml), written from overrides: what
`python train.py experiment=<name>` then runs, holding only what differs from the default job.
Group choices become the file's defaults list (`override /zero_stage: "3"`), other keys nested values."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from zerotune import CONF_DIR
from zerotune.cli.compose import parse_typed
from zerotune.cli.overrides import experiments_dir, group_options
from zerotune.errors import ConfigError

# A file name in one folder: no separators, no leading dot or dash, nothing a shell or Hydra must quote.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def experiment_path(name: str, key: str = "name") -> Path:
    """experiments/experiment/<name>.yaml, for a name that cannot leave that folder."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(key, f"{name!r} is not an experiment name: letters, digits, _ and - only (at most "
                          "64, starting with a letter or digit), no path separators or dots",
                          "e.g. my_zero3_cpu")
    return experiments_dir(CONF_DIR) / "experiment" / f"{name}.yaml"


def experiment_names() -> list[str]:
    folder = experiments_dir(CONF_DIR) / "experiment"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def experiment_yaml(overrides: list[str], comments: list[str] = ()) -> str:
    groups = set(group_options(CONF_DIR))
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

"""Make command lines work as users type them, before Hydra parses them.

Hydra 1.3 parses `zero_stage=2` as the int 2 and then refuses it as a config group choice
("Config group override must be a string or a list. Got int"). Group choices that look like
numbers are quoted here, in single values and in sweep lists (`zero_stage=1,2,3`). Optimizer
choices are normalised case-insensitively, and an unknown choice of any group is refused with the
list of options, in zerotune's error format.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zerotune.ds_config.optimizers import normalize
from zerotune.errors import ConfigError

_OVERRIDE = re.compile(r"^(?P<prefix>[+~]{0,2})(?P<key>[\w/.@-]+)=(?P<value>.*)$", re.S)
_SIMPLE_LIST = re.compile(r"^[\w.-]+(,[\w.-]+)*$")


def strip_local_rank(args: list[str]) -> list[str]:
    """The `deepspeed` launcher appends --local_rank=N, which Hydra refuses; LOCAL_RANK carries it instead."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(args):
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            skip = True
        else:
            out.append(arg)
    return out


def group_options(conf_dir: Path) -> dict[str, list[str]]:
    """{group: [option, ...]} for every top-level config group folder."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(conf_dir.iterdir()) if d.is_dir() and d.name != "hydra"}


def experiments_dir(conf_dir: Path) -> Path:
    """Experiment configs live beside conf/, in experiments/experiment/, with their results."""
    return conf_dir.parent / "experiments"


def normalize_overrides(args: list[str], conf_dir: Path) -> list[str]:
    groups = group_options(conf_dir)
    if (experiments_dir(conf_dir) / "experiment").is_dir():
        groups["experiment"] = sorted(p.stem for p in (experiments_dir(conf_dir) / "experiment").glob("*.yaml"))
    return [_normalize_one(arg, groups) for arg in args]


def with_search_path(args: list[str], conf_dir: Path) -> list[str]:
    """Add experiments/ to Hydra's search path, unless the user set their own."""
    if any(a.lstrip("+").startswith("hydra.searchpath=") for a in args):
        return args
    return [*args, f"hydra.searchpath=[file://{experiments_dir(conf_dir)}]"]


def _normalize_one(arg: str, groups: dict[str, list[str]]) -> str:
    m = _OVERRIDE.match(arg)
    if not m or m["key"] not in groups or not _SIMPLE_LIST.match(m["value"]):
        return arg  # not a plain group choice (quoted, a function such as range(), or not a group): Hydra's job
    key, options = m["key"], groups[m["key"]]
    choices = [_choose(key, v, options) for v in m["value"].split(",")]
    return f"{m['prefix']}{key}=" + ",".join(f"'{c}'" for c in choices)


def _choose(key: str, value: str, options: list[str]) -> str:
    if key == "optimizer":
        value = normalize(value, key="optimizer")
    if value not in options:
        custom = f"{key}.size={value}" if key == "resolution" else f"add conf/{key}/{value}.yaml"
        raise ConfigError(key, f"no option {value!r} in config group {key!r}",
                          f"choose one of: {', '.join(options)}, or {custom}")
    return value

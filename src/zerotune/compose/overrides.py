"""Make command lines work as users type them, before Hydra parses them.

Hydra 1.3 parses `zero_stage=2` as the int 2 and then refuses it as a config group choice
("Config group override must be a string or a list. Got int"). Group choices that look like
numbers are quoted here, in single values and in sweep lists (`zero_stage=1,2,3`). Optimizer
choices are normalised case-insensitively, and an unknown choice of any group is refused with the
list of options, in zerotune's error format. Each override is read by Hydra's own parser.
"""

from __future__ import annotations

import os
import re
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, QuotedString, ValueType
from hydra.errors import HydraException

from zerotune.compose import node
from zerotune.config_search import ConfigSearch
from zerotune.ds_config.optimizers import is_known, normalize
from zerotune.errors import ConfigError

node.register()  # conf/config.yaml names the schema; every composition goes through this module

_PARSER = OverridesParser.create()
_PLAIN = re.compile(r"^[\w./-]+$")  # a value that needs no quotes
_BEFORE_QUOTE = re.compile(r"(\\*)('|$)")


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


def typed_line(override: Override) -> str:
    """The override as it was typed. Hydra's parser sets it on every override it returns; Override declares it
    optional for the overrides built by hand."""
    assert override.input_line is not None
    return override.input_line


def normalize_overrides(args: list[str], search: ConfigSearch) -> list[str]:
    groups = search.group_options()
    return [_normalize_one(arg, groups) for arg in args]


def as_typed(overrides: list[str]) -> list[str]:
    """The overrides without the quotes `normalize_overrides` put around simple values: `zero_stage=2`."""
    out = []
    for line in overrides:
        parsed = _parse(line)
        if parsed is not None and isinstance(parsed._value, QuotedString) and _PLAIN.match(parsed.value()):
            line = f"{line.split('=', 1)[0]}={parsed.value()}"
        out.append(line)
    return out


def override(key: str, value: Any) -> str:
    """`key=value` in Hydra's override grammar, for a Python value (an empty string is null)."""
    return f"{key}={'null' if value == '' else hydra_value(value)}"


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar (not JSON: Hydra's map keys are bare, its strings single-quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text):
        return text
    # Hydra keeps a backslash literal unless quotes or the end follow it: only those runs are doubled.
    return "'" + _BEFORE_QUOTE.sub(lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text) + "'"


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def take_config_dir(args: list[str]) -> tuple[list[str], str | None]:
    """Hydra's `--config-dir DIR` (`-cd DIR`, `--config-dir=DIR`), taken off the command line: Hydra would
    search it after the packaged configs; zerotune searches it first (hydra_plugins/zerotune_user_configs)."""
    out, config_dir, i = [], None, 0
    while i < len(args):
        arg = args[i]
        if arg in CONFIG_DIR_FLAGS:
            if i + 1 >= len(args):
                raise ConfigError("--config-dir", "no folder follows it", "--config-dir ./zerotune")
            config_dir, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    return out, config_dir


def _parse(arg: str):
    """Hydra's own reading of one override, or None for what is not one (flags, Hydra's errors to report)."""
    if arg.startswith("-") or "=" not in arg:
        return None
    try:
        return _PARSER.parse_override(arg)
    except HydraException:  # OverrideParseException, or the HydraException its syntax errors raise
        return None


# `resume=<path>` named a checkpoint before resume had options of its own (resume.strict): it stays the short form.
_SHORT_FORMS = {"resume": "resume.path"}


def _normalize_one(arg: str, groups: dict[str, list[str]]) -> str:
    parsed = _parse(arg)
    if parsed is not None and parsed.key_or_group in _SHORT_FORMS and not parsed.is_delete():
        prefix = arg[: len(arg) - len(arg.lstrip("+"))]
        return f"{prefix}{_SHORT_FORMS[parsed.key_or_group]}{arg[arg.index('='):]}"
    if parsed is None or parsed.key_or_group not in groups or parsed.is_delete():
        return arg
    if parsed.value_type == ValueType.ELEMENT:
        values = [parsed._value]
    elif parsed.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
        values = parsed.value().list
    else:
        return arg  # choice(), range(), glob(): Hydra's own syntax, as written
    texts = [v.text if isinstance(v, QuotedString) else v for v in values]
    if not all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in texts):
        return arg
    key, options = parsed.key_or_group, groups[parsed.key_or_group]
    choices = [_choose(key, str(t), options) for t in texts]
    return f"{arg.split('=', 1)[0]}=" + ",".join(f"'{c}'" for c in choices)


# Groups whose options are all there can be: ZeRO has stages 0-3, DeepSpeed offloads to cpu or nvme, and
# precisions are DeepSpeed's. A YAML of a new name would configure nothing new, so none is suggested.
CLOSED_GROUPS = frozenset({"zero_stage", "offload", "precision", "adapter"})


def _choose(key: str, value: str, options: list[str]) -> str:
    # AdamW, CPUAdam: DeepSpeed's names in any case. A name it does not know may be a user's own option.
    if key == "optimizer" and value not in options and is_known(value):
        value = normalize(value, key="optimizer")
    if value not in options:
        fix = f"choose one of: {', '.join(options)}"
        if key == "resolution":
            fix += f", or {key}.size={value}"
        elif key not in CLOSED_GROUPS:
            fix += f", or add zerotune/{key}/{value}.yaml (in the working directory)"
        raise ConfigError(key, f"no option {value!r} in config group {key!r}", fix)
    return value

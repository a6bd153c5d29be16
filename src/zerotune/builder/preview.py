"""The live preview: the command line, the composed config and the validated DeepSpeed JSON for a filled
form, with the validator's error (the same one `zerotune train` stops with) placed at the form field its
key names."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

from zerotune import config_search
from zerotune.builder import form
from zerotune.compose import composed
from zerotune.errors import ConfigError
from zerotune.preflight import check
from zerotune.user_config.precedence import DS_KEY_SOURCES

# DeepSpeed's batch keys, by the zerotune key that sets each.
_BATCH_KEYS = {"train_micro_batch_size_per_gpu": "train.batch_size", "train_batch_size": "train.batch_size",
               "gradient_accumulation_steps": "train.grad_accum"}
_NAMED_KEY = re.compile(r"\(([\w.]+)\)")
_EXPANDS = re.compile(r'["$`\\!]')  # what a shell still reads inside double quotes


def preview(choices: dict[str, str], values: dict[str, Any], extra: Sequence[str] = ()) -> dict:
    try:
        overrides = form.overrides(choices, values, extra)
    except ConfigError as exc:  # a value Hydra cannot read
        return {"overrides": [], "command": None, "errors": [error_entry(exc)]}
    answer: dict[str, Any] = {"overrides": overrides, "command": command_line(overrides), "errors": []}
    try:
        found = composed(overrides)
        answer["choices"], answer["composed"], answer["values"] = found.choices, found.yaml(), form.knob_values(found)
        answer["ds_config"] = check(found.settled(overrides)).ds_config
    except ConfigError as exc:
        answer["errors"].append(error_entry(exc))
    return answer


def command_line(overrides: list[str]) -> str:
    """`zerotune train ...`, run from the page's working directory. A folder named by --config-dir is named
    again: the command would not find its options and experiments otherwise."""
    user = config_search.current().user
    folder = ["--config-dir", shlex.quote(str(user.path))] if user and user.how == "--config-dir" else []
    return " ".join(["zerotune", "train", *folder, *(shell_word(o) for o in overrides)])


def shell_word(arg: str) -> str:
    """`arg` as one shell word: bare when safe, in double quotes when nothing inside them expands (the way
    Hydra's docs write `"key='a b'"`), else shlex's quoting."""
    if shlex.quote(arg) == arg:
        return arg
    if not _EXPANDS.search(arg):
        return f'"{arg}"'
    return shlex.quote(arg)


def error_entry(exc: ConfigError) -> dict:
    return {"key": exc.key, "problem": exc.problem, "fix": exc.fix, "field": field_for(exc.key)}


def field_for(key: str) -> str | None:
    """The form field an error's key names: a zerotune key (or the one in brackets after a DeepSpeed key),
    the group a key belongs to, or the zerotune keys that set a DeepSpeed value. None: no field."""
    knobs = set(form.knob_keys())
    groups = set(form.defaults()[0])
    candidates = [*_NAMED_KEY.findall(key), key.split(" ")[0]]
    for candidate in candidates:
        candidate = _BATCH_KEYS.get(candidate, candidate)
        sources = DS_KEY_SOURCES.get(candidate.split(".")[0], (candidate,))
        for name in (candidate, *sources):
            if name in knobs:
                return name
            if name.split(".")[0] in groups:
                return name.split(".")[0]
    return None

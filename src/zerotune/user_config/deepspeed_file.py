"""Read a hand-written DeepSpeed JSON, as DeepSpeed, accelerate and the HF Trainer accept it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

from zerotune.errors import ConfigError
from zerotune.user_config import ds_keys, legacy

log = logging.getLogger(__name__)

KEY = "deepspeed.config_file"


class UserFile(NamedTuple):
    ds: dict              # in today's DeepSpeed spelling, less the keys it ignores
    warnings: list[str]   # one line per key left out or translated (summary.json's config_warnings)


def load(path: str, quiet: bool = False) -> UserFile:
    """The file's dict in today's DeepSpeed spelling and its warnings (logged unless `quiet`); a syntax error
    names its line and column, an unknown or refused top-level key its name (never its value: see ds_keys)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(KEY, f"{file} does not exist", f"point {KEY} at a DeepSpeed JSON file")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(KEY, f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                          "fix the JSON at that position") from None
    except UnicodeDecodeError:
        raise ConfigError(KEY, f"{file} is not a text file", f"point {KEY} at a DeepSpeed JSON file") from None
    if not isinstance(data, dict):
        raise ConfigError(KEY, f"{file} must hold a JSON object, not {type(data).__name__}",
                          'wrap the settings in { ... }')
    # The reference's config.json nests the dict under "deepspeed_config"; accept both shapes.
    data = data.get("deepspeed_config", data)
    if not isinstance(data, dict):
        raise ConfigError(KEY, f"\"deepspeed_config\" in {file} must be a JSON object", 'wrap it in { ... }')
    checked, dropped = ds_keys.check(data, file.name, KEY)
    ds, translated = legacy.translate(checked, file.name)
    if not quiet:
        for line in dropped + translated:
            log.warning("%s", line)
    return UserFile(ds, dropped + translated)

"""Read a hand-written DeepSpeed JSON, as DeepSpeed, accelerate and the HF Trainer accept it."""

from __future__ import annotations

import json
from pathlib import Path

from zerotune.errors import ConfigError
from zerotune.user_config import ds_keys, legacy

KEY = "deepspeed.config_file"


def load(path: str, key: str = KEY) -> dict:
    """The file's dict in today's DeepSpeed spelling; a syntax error names its line and column, an unknown or
    refused top-level key its name (never its value: see ds_keys)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"{file} does not exist", f"point {key} at a DeepSpeed JSON file")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(key, f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                          "fix the JSON at that position") from None
    except UnicodeDecodeError:
        raise ConfigError(key, f"{file} is not a text file", f"point {key} at a DeepSpeed JSON file") from None
    if not isinstance(data, dict):
        raise ConfigError(key, f"{file} must hold a JSON object, not {type(data).__name__}",
                          'wrap the settings in { ... }')
    # The reference's config.json nests the dict under "deepspeed_config"; accept both shapes.
    data = data.get("deepspeed_config", data)
    if not isinstance(data, dict):
        raise ConfigError(key, f"\"deepspeed_config\" in {file} must be a JSON object", 'wrap it in { ... }')
    return legacy.translate(ds_keys.check(data, file.name, key), file.name)

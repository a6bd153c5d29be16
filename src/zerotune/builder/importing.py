"""Import on the page: a pasted DeepSpeed JSON or accelerate config YAML becomes the zerotune overrides that
give the same DeepSpeed dict (zerotune.import_config does the work), plus the keys only the file expresses.
The text is parsed as data (json / yaml.safe_load), never run."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from zerotune.builder import form
from zerotune.builder.paths import imports_dir
from zerotune.compose.interpolation import check_pure_value
from zerotune.errors import ConfigError
from zerotune.import_config import overrides_for


def import_text(text: str) -> dict:
    kind, suffix, parsed = _kind(text)
    # Its strings become config values: a "${oc.env:...}" in them would be read when they are composed.
    check_pure_value("import", parsed, fix="put the value itself in the pasted file, in place of the ${...}")
    # import_config reads files, and a DeepSpeed JSON it cannot fully express stays in the overrides as
    # deepspeed.config_file=<path>: the text is kept under outputs/, named by its content.
    folder = imports_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}{suffix}"
    kept_before = path.exists()  # the same text, imported before: named by its content, so left as it is
    if not kept_before:
        path.write_text(text)
    try:
        overrides, differ = overrides_for(path)
    except BaseException:
        if not kept_before:
            path.unlink(missing_ok=True)  # a refused paste (a credentials file, say) is not kept on disk
        raise
    return {"kind": kind, "file": str(path), "overrides": overrides, "no_equivalent": differ, **form.as_form(overrides)}


def _kind(text: str) -> tuple[str, str, Any]:
    """("deepspeed" | "accelerate", the file suffix, the parsed data)."""
    stripped = text.lstrip()
    if not stripped:
        raise ConfigError("import", "nothing was pasted", "paste a DeepSpeed JSON or an accelerate config YAML")
    if stripped.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("import", f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                              "fix the JSON there (a trailing comma or a missing quote, often)") from None
        if not isinstance(parsed, dict):
            raise ConfigError("import", "the JSON is not an object", "paste a DeepSpeed config: {\"zero_optimization\": ...}")
        return "deepspeed", ".json", parsed
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("import", f"malformed YAML{where}: {getattr(exc, 'problem', None) or exc}",
                          "fix the YAML there") from None
    if not isinstance(parsed, dict) or not ({"compute_environment", "distributed_type", "deepspeed_config"} & set(parsed)):
        raise ConfigError("import", "neither a DeepSpeed JSON nor an accelerate config YAML",
                          "paste a DeepSpeed JSON ({...}) or what `accelerate config` wrote (default_config.yaml)")
    return "accelerate", ".yaml", parsed

"""What the user's files set and where each value came from (`UserConfig`), and how a key typed on the command
line is found (`typed_keys`, `pinned_by`). The rules of who wins are compose/settle.py's, which applies them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from zerotune.ds_config.batch import Batch
from zerotune.errors import ConfigError
from zerotune.user_config import file_fixes
from zerotune.user_config.file_fixes import GROUP_PINS

# The zerotune keys each top-level DeepSpeed key is generated from (for "where did this come from").
DS_KEY_SOURCES = {
    "gradient_clipping": ("train.grad_clip",),
    "zero_optimization": ("zero_stage.stage", "offload.device", "offload.params", "offload.path"),
    "optimizer": ("optimizer.name", "optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay"),
    "scheduler": ("scheduler.name", "scheduler.warmup_steps", "train.max_steps"),
    "fp16": ("precision.name",), "bf16": ("precision.name",), "aio": ("offload.device",),
}


# DeepSpeed keys zerotune generates from one of its own.
DS_TO_ZEROTUNE = {"gradient_clipping": "train.grad_clip"}
# The zerotune key behind the key of a check's error, to find where the user set it.
ERROR_SOURCES = {**DS_TO_ZEROTUNE, "zero_optimization.stage": "zero_stage.stage", "zero_stage": "zero_stage.stage",
                 "fp16.enabled": "precision.name", "bf16.enabled": "precision.name"}


@dataclass
class UserConfig:
    """The user's files, settled against the command line; the composed config already reflects them."""

    deepspeed: dict | None = None                 # the user's DeepSpeed dict, today's spelling
    deepspeed_path: str | None = None
    accelerate: list[dict] = field(default_factory=list)   # [{"origin", "how", "path"}] for the summary
    origins: dict[str, str] = field(default_factory=dict)  # zerotune key -> where its value came from
    typed: dict[str, str] = field(default_factory=dict)    # key typed on the command line -> the override
    batch: Batch | None = None
    batch_origins: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)     # the DeepSpeed file's keys left out or translated

    def origin_of(self, key: str) -> str:
        if key in self.origins:
            return self.origins[key]
        return "command line" if pinned_by(self.typed, key) else "default"

    def attribute(self, exc: ConfigError) -> ConfigError:
        """A problem with a value is reported where the user set it: a file's key (with the fix made there),
        or the zerotune key behind a generated DeepSpeed value. A fix's override that a file's value would
        refuse becomes the edit of that file."""
        key = DS_TO_ZEROTUNE.get(exc.key, exc.key)
        fix = file_fixes.rewrite(exc.fix, self.origins, self._ds_name(), list(self.typed.values()))
        origin = self.origins.get(ERROR_SOURCES.get(exc.key, exc.key))
        if origin is None or ": " not in origin:
            return exc if (key, fix) == (exc.key, exc.fix) else ConfigError(key, exc.problem, fix)
        name, where = origin.split(": ", 1)
        # A value generated from one zerotune key is that key in the file: its problem says what is valid.
        direct = exc.key in DS_TO_ZEROTUNE or fix == exc.fix
        return ConfigError(where, f"{exc.problem} ({name})", file_fixes.change(origin) if direct else fix)

    def _ds_name(self) -> str | None:
        return Path(self.deepspeed_path).name if self.deepspeed_path else None

    def summary(self, ds: dict) -> dict:
        """The files used, the origins of zerotune's keys, and for each top-level key of the final DeepSpeed
        dict where its value came from: file, command line, default, or derived."""
        name = self._ds_name()
        values = {}
        for key in ds:
            if key in self.batch_origins:
                values[key] = self.batch_origins[key]
            elif self.deepspeed is not None and key in self.deepspeed:
                fillers = {self.origin_of(k) for k in DS_KEY_SOURCES.get(key, ())} - {
                    o for o in self.origins.values() if o.startswith(f"{name}:")}
                values[key] = f"file {name}" + (f" (\"auto\" filled from: {', '.join(sorted(fillers or {'zerotune'}))})"
                                                if _has_auto(self.deepspeed[key]) else "")
                if key == "zero_optimization" and set(ds[key]) - set(self.deepspeed[key]):
                    values[key] += "; other keys: zerotune defaults"
            elif key in DS_KEY_SOURCES:
                values[key] = ", ".join(sorted({self.origin_of(k) for k in DS_KEY_SOURCES[key]}))
            else:
                values[key] = "zerotune"
        return {"deepspeed_config_file": self.deepspeed_path, "accelerate_config": self.accelerate,
                "origins": dict(self.origins), "values": values}


def typed_keys(overrides: list[str]) -> dict[str, str]:
    """{key or group: the override as typed} for the command line's overrides, parsed by Hydra's own parser."""
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if "=" in o])
    return {o.key_or_group: str(o.input_line) for o in parsed  # Hydra's parser always sets input_line
            if not o.key_or_group.startswith("hydra") and not o.is_delete()}


def pinned_by(typed: dict[str, str], key: str) -> str | None:
    """The typed override that fixes `key`, if any."""
    for typed_key, line in typed.items():
        if typed_key == key or key.startswith(typed_key + ".") and typed_key not in GROUP_PINS:
            return line
        if key in GROUP_PINS.get(typed_key, ()):
            return line
    return None


def _has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    return value == "auto"

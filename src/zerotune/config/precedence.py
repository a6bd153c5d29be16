"""What the user's files set and where each value came from (`UserConfig`), which keys the command line typed, and
fixes that work when applied: a fix's override of a value a file states would be refused, so it becomes the edit of
that file. The rules of who wins are config/compose/settle.py's."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from zerotune.config.accelerate_file import OPTIMIZER_PARAMS, ZERO_KNOBS
from zerotune.config.deepspeed_blocks import DEEPSPEED_TYPES, Batch, normalize
from zerotune.config.errors import ConfigError

# An override as checks write it in a fix: `zero_stage=3`, `offload.params=false`, `zero_stage.stage=<0 or 1>`;
# a "use " before it is dropped with it when it becomes an edit.
OVERRIDE = re.compile(r"(?P<use>\buse )?(?<![\w./<-])(?P<key>[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)="
                      r"(?P<value><[^>]*>|[^\s,;()]+)")
# Where a fix offers to plan the config for a card; replaced by the command line's own overrides.
OVERRIDES_PLACEHOLDER = "<overrides>"

# A group choice on the command line (`zero_stage=2`) pins the keys that identify the option, not the
# option's other values: `optimizer=adamw` does not pin optimizer.lr against a file's lr.
GROUP_PINS = {"zero_stage": ("zero_stage.stage",), "offload": ("offload.device", "offload.params"),
              "precision": ("precision.name",), "optimizer": ("optimizer.name",), "scheduler": ("scheduler.name",)}
# The keys a file may state that make an override of a fix useless: a file's offload blocks are taken whole,
# so a typed NVMe folder never reaches them.
PINS = {**GROUP_PINS, "offload.path": ("offload.path", "offload.device")}

# zerotune keys that one DeepSpeed key states.
DS_PATHS = {"train.grad_clip": "gradient_clipping", "train.batch_size": "train_micro_batch_size_per_gpu",
            "train.grad_accum": "gradient_accumulation_steps", "zero_stage": "zero_optimization.stage",
            "zero_stage.stage": "zero_optimization.stage",
            **{f"optimizer.{p}": f"optimizer.params.{p}" for p in OPTIMIZER_PARAMS},
            **{f"deepspeed.{k}": f"zero_optimization.{k}" for k in ZERO_KNOBS}}

PRECISION_BLOCKS = {"fp32": '"fp16": {"enabled": false} and "bf16": {"enabled": false}',
                    "bf16": '"bf16": {"enabled": true} and "fp16": {"enabled": false}',
                    "fp16": '"fp16": {"enabled": true} and "bf16": {"enabled": false}'}


def _offload(value: str) -> str:
    if value == "none":
        return "delete zero_optimization.offload_optimizer and zero_optimization.offload_param"
    return f'set "device": "{value}" in zero_optimization\'s offload blocks'


def _offload_params(value: str) -> str:
    if value.lower() == "false":
        return "delete zero_optimization.offload_param"
    return 'add "offload_param": {"device": "cpu"} to zero_optimization'


def _optimizer(value: str) -> str | None:
    try:
        return f'set optimizer.type to "{DEEPSPEED_TYPES[normalize(value)]}"'
    except ConfigError:  # a fix naming no optimizer zerotune knows keeps its own words
        return None


EDITS: dict[str, Callable[[str], str | None]] = {
    "precision": lambda value: f"set {PRECISION_BLOCKS[value]}" if value in PRECISION_BLOCKS else None,
    "offload": _offload, "offload.params": _offload_params, "optimizer": _optimizer,
    "offload.path": lambda value: f'set "nvme_path" to {value} in zero_optimization\'s offload blocks',
}


def rewrite(fix: str, origins: dict[str, str], ds_file: str | None, typed: list[str]) -> str:
    """`fix` with each override a file would refuse replaced by that file's edit, and the plan command's
    placeholder by the command line's overrides. `origins`: zerotune key -> "file: key" it came from."""
    out, end, joined = [], 0, False
    for match in OVERRIDE.finditer(fix):
        edit = _edit_for(match.group("key"), match.group("value"), origins, ds_file)
        between = fix[end:match.start()]
        # overrides side by side ("zero_stage=3 offload=nvme") are one fix: their edits are joined by "and"
        side_by_side = end > 0 and between == " " and match.group("use") is None
        out.append(" and " if side_by_side and (edit or joined) else between)
        out.append(edit if edit else match.group(0))
        end, joined = match.end(), edit is not None
    rewritten = "".join(out) + fix[end:]
    return rewritten.replace(OVERRIDES_PLACEHOLDER + " ", "".join(f"{shlex.quote(t)} " for t in typed))


def _edit_for(override: str, value: str, origins: dict[str, str], ds_file: str | None) -> str | None:
    """The file edit replacing `override=value`, or None where no file states what it sets."""
    origin = next((origins[k] for k in PINS.get(override, (override,)) if k in origins), None)
    if origin is None:
        return None
    name = origin.partition(": ")[0]
    edit = None
    if name == ds_file and override in EDITS:
        edit = EDITS[override](value)
    elif name == ds_file and override in DS_PATHS:
        edit = f"set {DS_PATHS[override]} to {' or '.join(value.split('|'))}"
    return f"{edit} in {name}" if edit else change(origin)


def change(origin: str) -> str:
    """'change zero_optimization.stage in ds.json', from an origin 'ds.json: zero_optimization.stage'."""
    name, _, where = origin.partition(": ")
    if name == "accelerate launch":
        return f"change {where} in the config file given to `accelerate launch`"
    return f"change {where} in {name}"


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
        fix = rewrite(exc.fix, self.origins, self._ds_name(), list(self.typed.values()))
        origin = self.origins.get(ERROR_SOURCES.get(exc.key, exc.key))
        if origin is None or ": " not in origin:
            return exc if (key, fix) == (exc.key, exc.fix) else ConfigError(key, exc.problem, fix)
        name, where = origin.split(": ", 1)
        # A value generated from one zerotune key is that key in the file: its problem says what is valid.
        direct = exc.key in DS_TO_ZEROTUNE or fix == exc.fix
        return ConfigError(where, f"{exc.problem} ({name})", change(origin) if direct else fix)

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

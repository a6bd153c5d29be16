"""Who wins: the command line, the user's files, or zerotune's defaults.

- A value the file states replaces the group default (the composed config is updated, so config.yaml,
  summary choices, reports, offload handling and measurement all describe what runs).
- A value typed on the command line that contradicts a file is an error naming both sides.
- Two files (an accelerate YAML and the DeepSpeed JSON it names) that disagree are an error too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from zerotune.compose.overrides import typed_line
from zerotune.ds_config.batch import Batch, Known, solve
from zerotune.errors import ConfigError
from zerotune.schema import launch_world_size
from zerotune.user_config import accelerate_config, deepspeed_file, file_fixes
from zerotune.user_config.file_fixes import GROUP_PINS
from zerotune.user_config.settings import Setting, from_accelerate, from_deepspeed, stated

log = logging.getLogger(__name__)


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
    return {o.key_or_group: typed_line(o) for o in parsed
            if not o.key_or_group.startswith("hydra") and not o.is_delete()}


def pinned_by(typed: dict[str, str], key: str) -> str | None:
    """The typed override that fixes `key`, if any."""
    for typed_key, line in typed.items():
        if typed_key == key or key.startswith(typed_key + ".") and typed_key not in GROUP_PINS:
            return line
        if key in GROUP_PINS.get(typed_key, ()):
            return line
    return None


def resolve(cfg: DictConfig, overrides: list[str] | tuple = (), world_size: int | None = None,
            environ: dict | None = None, quiet: bool = False) -> UserConfig:
    """Fold the user's accelerate config(s) and DeepSpeed JSON into `cfg` (settle's own copy of the composed
    config), in place; return what was used.
    `quiet`: the file's warnings are only recorded (a later resolve of the same files says them)."""
    user = UserConfig(typed=typed_keys(list(overrides)))
    applied: dict[str, Setting] = {}
    for acc in accelerate_config.find(cfg.accelerate.config_file, environ):
        user.accelerate.append({"origin": acc.origin, "how": acc.how, "path": acc.path})
        if acc.how == "default location":
            log.info("read accelerate's default config %s (accelerate.config_file=null to ignore it)", acc.path)
        for s in from_accelerate(acc, launched_externally=acc.how == "environment"):
            _apply(cfg, s, applied, user)
    path = cfg.deepspeed.config_file
    if path:
        user.deepspeed_path = str(Path(str(path)).expanduser())
        user.deepspeed, user.warnings = deepspeed_file.load(user.deepspeed_path, quiet=quiet)
        for s in from_deepspeed(user.deepspeed, Path(user.deepspeed_path).name):
            _apply(cfg, s, applied, user)
    # the batch: DeepSpeed's three keys, the command line and the defaults settled together
    world = launch_world_size(cfg.launch) if world_size is None else world_size
    ds = user.deepspeed or {}
    name = user._ds_name()

    def known(ds_key: str, cfg_key: str) -> Known | None:
        in_file = ds.get(ds_key)
        line = pinned_by(user.typed, cfg_key)
        typed_value = OmegaConf.select(cfg, cfg_key) if line else None
        if stated(in_file) and typed_value is not None and not _same(cfg_key, typed_value, in_file):
            raise ConfigError(ds_key, f"the command line says `{line}` but {name} says {ds_key}: {in_file}",
                              f"drop `{line}` from the command line, or change {ds_key} in {name}")
        if stated(in_file):
            return Known.read(in_file, f"{name}", ds_key, name)
        if line:
            return Known.read(typed_value, "command line", cfg_key)
        if cfg_key in user.origins:  # from an accelerate config
            return Known(OmegaConf.select(cfg, cfg_key), user.origins[cfg_key], cfg_key)
        return None

    micro = known("train_micro_batch_size_per_gpu", "train.batch_size")
    accum = known("gradient_accumulation_steps", "train.grad_accum")
    total_in_file = ds.get("train_batch_size")
    total = Known.read(total_in_file, f"{name}", "train_batch_size", name) if stated(total_in_file) else None
    defaults = (Known(OmegaConf.select(cfg, "train.batch_size"), "default", "train.batch_size"),
                Known(OmegaConf.select(cfg, "train.grad_accum"), "default", "train.grad_accum"))
    user.batch = solve(micro, accum, total, world, *defaults)
    procs = f"{world} process{'es' if world > 1 else ''}"

    def part_origin(part: Known | None, cfg_key: str) -> str:
        if part is not None:
            return part.origin
        if total is not None:
            return f"derived: train_batch_size / (the other factor x {procs})"
        return user.origin_of(cfg_key)

    user.batch_origins = {
        "train_batch_size": total.origin if total else f"derived: micro batch x accumulation x {procs}",
        "train_micro_batch_size_per_gpu": part_origin(micro, "train.batch_size"),
        "gradient_accumulation_steps": part_origin(accum, "train.grad_accum")}
    OmegaConf.update(cfg, "train.batch_size", user.batch.micro, merge=False)
    OmegaConf.update(cfg, "train.grad_accum", user.batch.accum, merge=False)
    return user


def _apply(cfg: DictConfig, s: Setting, applied: dict[str, Setting], user: UserConfig) -> None:
    if s.key == "precision.not":  # a file says "fp16.enabled: false"
        if cfg.precision.name != s.value:
            return
        s = Setting("precision.name", "fp32", s.origin)
    earlier = applied.get(s.key)
    if earlier is not None and not _same(s.key, earlier.value, s.value):
        raise ConfigError(s.key, f"{earlier.origin} says {earlier.value!r} but {s.origin} says {s.value!r}",
                          "make the two files agree (or drop one of them)")
    current = OmegaConf.select(cfg, s.key, default=None)
    line = pinned_by(user.typed, s.key)
    if line is not None and current != "auto" and not _same(s.key, current, s.value):
        raise ConfigError(s.key, f"the command line says `{line}` but {s.origin} says {s.value!r}",
                          f"drop `{line}` from the command line, or {file_fixes.change(s.origin)}")
    applied[s.key] = s
    user.origins[s.key] = s.origin
    if not _same(s.key, current, s.value):
        log.info("%s = %r, from %s", s.key, s.value, s.origin)
        OmegaConf.update(cfg, s.key, s.value, merge=False, force_add=True)


def _same(key: str, a: Any, b: Any) -> bool:
    if OmegaConf.is_config(a):
        a = OmegaConf.to_container(a, resolve=True)
    if key.endswith("path") or key.endswith("config_file"):
        return a is not None and b is not None and os.path.abspath(os.path.expanduser(str(a))) == \
            os.path.abspath(os.path.expanduser(str(b)))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(key, x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    return value == "auto"

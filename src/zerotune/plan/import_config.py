"""`zerotune import-config`: an accelerate YAML or a DeepSpeed JSON as zerotune overrides (or an experiment file),
checked by comparing the DeepSpeed dicts both build; what the overrides cannot express keeps the file in them."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from zerotune.config import compose, search
from zerotune.config.compose import compose_settled
from zerotune.config.compose.overrides import override
from zerotune.config.precedence import GROUP_PINS
from zerotune.config.schema import Config, as_dict
from zerotune.host.platform import ANY_CUDA_GPU
from zerotune.plan.resolve import check

# Keys zerotune sets for itself (logging, DeepSpeed's optimizer gate); a file's values for them change nothing.
OWN_KEYS = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"}
# zerotune key -> the config group whose option it names.
GROUP_KEYS = {keys[0]: group for group, keys in GROUP_PINS.items()}


def file_override(path: Path) -> str:
    key = "accelerate.config_file" if path.suffix in (".yaml", ".yml") else "deepspeed.config_file"
    return f"{key}={path.resolve()}"


def overrides_for(path: Path) -> tuple[list[str], list[str]]:
    """(overrides, keys only the file can express). Raises ConfigError for a file zerotune refuses."""
    file_only = [file_override(path)] + ([] if path.suffix in (".yaml", ".yml") else ["accelerate.config_file=null"])
    resolved = check(compose_settled(file_only, typed=[]), ANY_CUDA_GPU)
    origins = resolved.config_sources["origins"]
    ordered = [k for k in GROUP_KEYS if k in origins] + sorted(k for k in origins if k not in GROUP_KEYS)
    overrides = [_override(key, _value(resolved.config, key)) for key in ordered]
    from_file = resolved.ds_config
    for key, ds_key in (("train.batch_size", "train_micro_batch_size_per_gpu"),
                        ("train.grad_accum", "gradient_accumulation_steps")):
        if resolved.config_sources["values"].get(ds_key, "default") != "default" and not any(
                o.startswith(f"{key}=") for o in overrides):
            overrides.append(f"{key}={from_file[ds_key]}")
    overrides = [o for o in overrides if not o.startswith(("deepspeed.config_file=", "accelerate.config_file="))]
    rebuilt = check(compose_settled([*overrides, "accelerate.config_file=null"], typed=[]), ANY_CUDA_GPU).ds_config
    from_file, rebuilt = _comparable(from_file), _comparable(rebuilt)
    differ = sorted(k for k in set(from_file) | set(rebuilt)
                    if k not in OWN_KEYS and from_file.get(k) != rebuilt.get(k))
    if differ:
        ds_path = resolved.config_sources.get("deepspeed_config_file") or str(path.resolve())
        overrides.append(f"deepspeed.config_file={ds_path}")
    return overrides + ["accelerate.config_file=null"], differ


def _comparable(ds: dict) -> dict:
    """A disabled fp16/bf16 block means the same as none."""
    return {k: v for k, v in ds.items() if not (k in ("fp16", "bf16") and not v.get("enabled"))}


def _value(cfg: Config, key: str) -> Any:
    """The value at a dotted key of the resolved config (a block as a plain dict)."""
    value = functools.reduce(getattr, key.split("."), cfg)
    return as_dict(value) if dataclasses.is_dataclass(value) else value


def _override(key: str, value: Any) -> str:
    group = GROUP_KEYS.get(key)
    if group is not None and str(value) in search.current().group_options().get(group, []):
        return f"{group}={value}"
    return override(key, value)


def experiment_yaml(source: Path, overrides: list[str], differ: list[str]) -> str:
    comments = [f"Imported from {source.resolve()}", f"(zerotune import-config {source.name} --save ...)."]
    if differ:
        comments.append(f"The file itself stays in use for: {', '.join(differ)}.")
    return compose.experiment_yaml(overrides, comments)

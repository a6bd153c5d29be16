"""Read a hand-written DeepSpeed JSON, as DeepSpeed, accelerate and the HF Trainer accept it.

Keys that older DeepSpeed configs still carry are translated to today's spelling (`translate`). DeepSpeed itself either
accepts the old spelling silently (`cpu_offload`, which then escapes zerotune's offload handling) or stops
with an exception, so they are settled here first. Removed features are refused by `ds_keys`."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import NamedTuple

from zerotune.errors import ConfigError
from zerotune.user_config import ds_keys

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
    ds, translated = translate(checked, file.name)
    if not quiet:
        for line in dropped + translated:
            log.warning("%s", line)
    return UserFile(ds, dropped + translated)


# zero_optimization keys renamed without a change of meaning.
RENAMED_ZERO = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "allgather_size": "allgather_bucket_size",
}
# Field names DeepSpeed accepts beside their documented aliases; one spelling, so a merge never holds both.
SYNONYMS_ZERO = {
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
}


def translate(ds: dict, source: str) -> tuple[dict, list[str]]:
    """A copy of the user's dict in today's spelling, and one warning line for each change (deepspeed_file logs
    them)."""
    ds = copy.deepcopy(ds)
    notes: list[str] = []

    def warn(old: str, new: str) -> None:
        notes.append(f"{source}: {old} is a deprecated DeepSpeed key; read as {new}")

    if "bfloat16" in ds:  # DeepSpeed's older alias of "bf16"
        warn("bfloat16", "bf16")
        ds["bf16"] = {**ds.pop("bfloat16"), **ds.get("bf16", {})}
    if "fp32_allreduce" in ds:  # older DeepSpeed's flag: all-reduce gradients in fp32
        on = bool(ds.pop("fp32_allreduce"))
        warn(f"fp32_allreduce: {str(on).lower()}", "communication_data_type: \"fp32\"" if on else "nothing")
        if on:
            ds.setdefault("communication_data_type", "fp32")
    zero = ds.get("zero_optimization")
    if isinstance(zero, bool):  # the oldest form: "zero_optimization": true means stage 1
        warn(f"zero_optimization: {str(zero).lower()}", f"zero_optimization: {{\"stage\": {int(zero)}}}")
        ds["zero_optimization"] = {"stage": int(zero)}
    if not isinstance(zero, dict):
        return ds, notes
    for name, alias in SYNONYMS_ZERO.items():
        if name in zero:
            zero.setdefault(alias, zero.pop(name))
    for old, new in RENAMED_ZERO.items():
        if old in zero:
            warn(f"zero_optimization.{old}", f"zero_optimization.{new}")
            zero.setdefault(new, zero.pop(old))
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for old, block in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param"),
                       ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        on = zero.pop(old)
        if block in zero:
            raise ConfigError(f"zero_optimization.{old}", f"both {old} (deprecated) and {block} are set ({source})",
                              f"delete {old}; {block} says where it goes")
        if on:
            zero[block] = {"device": "cpu", "pin_memory": bool(pin)}
            warn(f"zero_optimization.{old}: true",
                 f"zero_optimization.{block}: {{\"device\": \"cpu\", \"pin_memory\": {str(bool(pin)).lower()}}}")
    return ds, notes

"""The candidates a tune sweep considers: the command line's fixed values and lists, over the sweeper's space.

A knob the command line gives one value is fixed; a list (`zero_stage=1,2,3`) bounds it; a knob it does not
name takes `hydra.sweeper.space`'s values. Any other key given one value is part of the workload, the same
in every trial; a list there is refused (it would compare different workloads). The micro batch and the
accumulation share the global batch: `train.grad_accum` is derived for each candidate.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from zerotune.compose.overrides import as_typed, typed_line
from zerotune.errors import ConfigError

KNOBS = ("zero_stage", "offload", "optimizer", "train.batch_size", "train.gradient_checkpointing", "deepspeed.overlap_comm",
         "deepspeed.reduce_bucket_size", "deepspeed.allgather_bucket_size", "deepspeed.stage3_prefetch_bucket_size",
         "launch.num_processes", "launch.threads")
# ZeRO's own settings: DeepSpeed reads them at stages 1-3 only, so stage 0 tries their first value alone.
ZERO_ONLY = ("deepspeed.overlap_comm", "deepspeed.reduce_bucket_size", "deepspeed.allgather_bucket_size",
             "deepspeed.stage3_prefetch_bucket_size")
AUTO_MICRO_BATCHES = 3  # train.batch_size: auto tries the largest three powers of two that divide a rank's share


@dataclass(frozen=True)
class Candidate:
    knobs: dict[str, str]                 # knob -> value, as Hydra reads it on a command line
    grad_accum: int

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.knobs.items()] + [f"train.grad_accum={self.grad_accum}"]

    def label(self) -> str:
        return _label(self.knobs)


@dataclass
class CommandLine:
    workload: list[str] = field(default_factory=list)     # the same in every trial
    accumulation: list[str] = field(default_factory=list)  # train.grad_accum as given: for the global batch only
    values: dict[str, list[str]] = field(default_factory=dict)  # knob -> its values, given or bounded

    @property
    def fixed(self) -> set[str]:
        """The knobs given one value."""
        return {key for key, given in self.values.items() if len(given) == 1}


def read_command_line(arguments: list[str]) -> CommandLine:
    """Split the sweep's overrides, as Hydra's own parser reads them, into the workload and the knobs."""
    line = CommandLine()
    for o in OverridesParser.create().parse_overrides(arguments):
        key = o.get_key_element().lstrip("+~")
        if key == "train.grad_accum":
            line.accumulation.append(typed_line(o))  # read once, for the global batch; each trial gets its own
        elif key in KNOBS:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            line.values[key] = values
        elif o.is_sweep_override():
            raise ConfigError(key, "a list here would compare different workloads: tune searches one workload's "
                                   f"knobs ({', '.join(KNOBS)})",
                              f"give {key} one value, and run one tune per value")
        else:
            line.workload.append(typed_line(o))
    return line


def knob_values(line: CommandLine, space: dict[str, Any], gpus: int) -> dict[str, list[str]]:
    """Every knob's values: the command line's, else the space's (auto expanded), else one: unset."""
    values: dict[str, list[str]] = {}
    for key in KNOBS:
        if key in line.values:
            values[key] = line.values[key]
        elif key in space and key != "train.batch_size":
            given = space[key]
            values[key] = _auto(key, gpus) if given == "auto" else [_text(v) for v in _as_list(given)]
    return values


def candidates(values: dict[str, list[str]], global_batch: int, nnodes: int,
               batch_space: Any) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The product of the knobs' values, each with its micro batch and accumulation; and what was left out, why."""
    keys = [k for k in values if k != "train.batch_size"]
    out, dropped, seen = [], [], set()
    for combo in itertools.product(*(values[k] for k in keys)):
        knobs = dict(zip(keys, combo, strict=True))
        if str(knobs.get("zero_stage", "")).strip("'\"") == "0":
            if any(knobs.get(k) != values[k][0] for k in ZERO_ONLY if k in knobs):
                continue  # the same run as with the first value
        ranks = int(knobs.get("launch.num_processes", 1)) * nnodes
        if global_batch % ranks:
            dropped.append((_label(knobs), f"the global batch {global_batch} does not divide among {ranks} ranks"))
            continue
        share = global_batch // ranks
        micro = values.get("train.batch_size") or _micro_batches(share, batch_space)
        for m in micro:
            full = {**knobs, "train.batch_size": str(m)}
            if share % int(m):
                dropped.append((_label(full), f"micro batch {m} does not divide a rank's {share} samples"))
            elif _label(full) not in seen:
                seen.add(_label(full))
                out.append(Candidate(full, share // int(m)))
    return out, dropped


def _micro_batches(share: int, batch_space: Any) -> list[str]:
    if batch_space not in (None, "auto"):
        return [_text(v) for v in _as_list(batch_space)]
    powers = [2 ** i for i in range(share.bit_length()) if share % 2 ** i == 0]
    choices = sorted({*powers, share}, reverse=True)[:AUTO_MICRO_BATCHES]
    return [str(m) for m in choices]


def _auto(key: str, gpus: int) -> list[str]:
    """launch.num_processes: every GPU here (one process each); a CPU host: 1, 2, 4 ... up to its cores.
    Anything else: its own default (auto)."""
    if key != "launch.num_processes":
        return ["auto"]
    if gpus:
        return [str(gpus)]
    cores = len(os.sched_getaffinity(0))
    return [str(2 ** i) for i in range(cores.bit_length()) if 2 ** i <= cores]


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _label(knobs: dict[str, str]) -> str:
    """As a user types them: zero_stage=2, not Hydra's zero_stage='2'."""
    return " ".join(as_typed([f"{k}={v}" for k, v in knobs.items()]))

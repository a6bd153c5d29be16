"""A fix must work when applied. Checks write their fixes as overrides (`precision=fp32`), but an override of a
value a file states is refused by the precedence rules ("the command line says ... but the file says ..."):
such an override is rewritten here into the edit of that file.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable

from zerotune.ds_config.optimizers import DEEPSPEED_TYPES, normalize
from zerotune.errors import ConfigError
from zerotune.user_config.settings import OPTIMIZER_PARAMS, ZERO_KNOBS

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

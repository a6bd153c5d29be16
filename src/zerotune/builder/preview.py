"""The live preview: the command line, the composed config and the validated DeepSpeed JSON for a filled form, the
validator's error at the field its key names; and will it fit: the planner's prediction (GPU peak as a stacked bar,
host and NVMe peaks, the time floor) and its "cheapest that fits" ranking, put back into the form."""

from __future__ import annotations

import re
import shlex
import threading
from collections.abc import Sequence
from typing import Any, TypedDict

from zerotune.builder import form
from zerotune.config import search
from zerotune.config.compose import composed
from zerotune.config.errors import ConfigError
from zerotune.config.precedence import DS_KEY_SOURCES
from zerotune.plan import gpus
from zerotune.plan.command_line import plan_all, plan_one
from zerotune.plan.resolve import check
from zerotune.rundir.plan import Plan, Term

# DeepSpeed's batch keys, by the zerotune key that sets each.
_BATCH_KEYS = {"train_micro_batch_size_per_gpu": "train.batch_size", "train_batch_size": "train.batch_size",
               "gradient_accumulation_steps": "train.grad_accum"}
_NAMED_KEY = re.compile(r"\(([\w.]+)\)")
_EXPANDS = re.compile(r'["$`\\!]')  # what a shell still reads inside double quotes


def preview(choices: dict[str, str], values: dict[str, Any], extra: Sequence[str] = ()) -> dict:
    try:
        overrides = form.overrides(choices, values, extra)
    except ConfigError as exc:  # a value Hydra cannot read
        return {"overrides": [], "command": None, "errors": [error_entry(exc)]}
    answer: dict[str, Any] = {"overrides": overrides, "command": command_line(overrides), "errors": []}
    try:
        found = composed(overrides)
        answer["choices"], answer["composed"], answer["values"] = found.choices, found.yaml(), form.knob_values(found)
        answer["ds_config"] = check(found.settled(overrides)).ds_config
    except ConfigError as exc:
        answer["errors"].append(error_entry(exc))
    return answer


def command_line(overrides: list[str]) -> str:
    """`zerotune train ...`, run from the page's working directory. A folder named by --config-dir is named
    again: the command would not find its options and experiments otherwise."""
    user = search.current().user
    folder = ["--config-dir", shlex.quote(str(user.path))] if user and user.how == "--config-dir" else []
    return " ".join(["zerotune", "train", *folder, *(shell_word(o) for o in overrides)])


def shell_word(arg: str) -> str:
    """`arg` as one shell word: bare when safe, in double quotes when nothing inside them expands (the way
    Hydra's docs write `"key='a b'"`), else shlex's quoting."""
    if shlex.quote(arg) == arg:
        return arg
    if not _EXPANDS.search(arg):
        return f'"{arg}"'
    return shlex.quote(arg)


def error_entry(exc: ConfigError) -> dict:
    return {"key": exc.key, "problem": exc.problem, "fix": exc.fix, "field": field_for(exc.key)}


def field_for(key: str) -> str | None:
    """The form field an error's key names: a zerotune key (or the one in brackets after a DeepSpeed key),
    the group a key belongs to, or the zerotune keys that set a DeepSpeed value. None: no field."""
    knobs = set(form.knob_keys())
    groups = set(form.defaults()[0])
    candidates = [*_NAMED_KEY.findall(key), key.split(" ")[0]]
    for candidate in candidates:
        candidate = _BATCH_KEYS.get(candidate, candidate)
        sources = DS_KEY_SOURCES.get(candidate.split(".")[0], (candidate,))
        for name in (candidate, *sources):
            if name in knobs:
                return name
            if name.split(".")[0] in groups:
                return name.split(".")[0]
    return None


# One trace at a time: a cold SDXL trace takes every core for seconds; previews meanwhile go on.
TRACE_LOCK = threading.Lock()
# The bar's segments, in stacking order, and which planner terms each holds.
CATEGORIES = {
    "context": ("cuda_context", "cublas_workspace"),
    "parameters": ("params", "params_persistent", "allocator_rounding"),
    "gradients and buckets": ("grads", "step_fp32_grads", "step_flat_grad_partition", "step_fp32_grad_sub_group"),
    "optimizer states": ("master_weights", "optimizer_states", "optimizer_temporaries"),
    "activations": ("activations", "activations_and_grads"),
}


def card(name: str | None, mib: Any) -> gpus.GPU | None:
    """The card picked on the page: a catalog name, or typed MiB (with no throughput figures)."""
    try:
        memory = None if mib in (None, "") else int(str(mib).strip())
    except ValueError:
        memory = mib  # gpus.lookup names the key and the fix
    return gpus.lookup(name or None, memory, key="gpu")


def plan_job(overrides: list[str], gpu: gpus.GPU | None) -> Plan:
    return plan_one(overrides, gpu, trace_lock=TRACE_LOCK)


def fit(choices: dict[str, str], values: dict[str, Any], extra: list[str], gpu_name: str | None,
        gpu_mib: Any) -> dict:
    gpu = card(gpu_name, gpu_mib)
    overrides = form.overrides(choices, values, extra)
    plan = plan_job(overrides, gpu)
    # the bar is the step at its largest moment: what it holds throughout and that moment's own terms
    return {**plan.to_dict(), "bar": bar(plan.terms_at_peak()), "phase_marks": phase_marks(plan)}


def phase_marks(plan: Plan) -> list[dict]:
    """One mark per phase of the run on the bar, when the plan has them (plan/phases.py): what nvidia-smi shows
    during it (reserved_mib) and whether it is the run's peak; [] without phases."""
    return [{"phase": p.phase, "mib": p.reserved_mib, "own_peak_mib": p.peak_mib, "run_peak": p.run_peak}
            for p in plan.phases]


def cheapest(choices: dict[str, str], values: dict[str, Any], extra: list[str], gpu_name: str | None,
             gpu_mib: Any) -> dict:
    """The --all ranking for this workload; `form` is the recommendation as the page's form (None: nothing fits)."""
    gpu = card(gpu_name, gpu_mib)
    stripped = {k: v for k, v in values.items() if k != "train.gradient_checkpointing"}
    overrides = [o for o in form.overrides(choices, stripped, extra) if o.split("=")[0] not in ("zero_stage", "offload")]
    answer = plan_all(overrides, gpu, plan_job)
    best = next((o for o in answer["options"] if o["fits"]), None)
    answer["form"] = None if best is None else {
        "choices": {**choices, "zero_stage": str(best["zero_stage"]), "offload": best["offload"]},
        "values": {**values, "train.gradient_checkpointing": best["gradient_checkpointing"]}}
    return answer


class BarSegment(TypedDict):
    """One segment of the page's memory bar: its planner terms and their sum."""

    segment: str
    mib: float
    terms: list[str]


def bar(terms: list[Term]) -> list[BarSegment]:
    """The GPU terms summed per segment; a DeepSpeed buffer counts with the gradients and buckets."""
    segments = {name: BarSegment(segment=name, mib=0.0, terms=[]) for name in CATEGORIES}
    for term in terms:
        name = next((seg for seg, members in CATEGORIES.items() if term.term in members),
                    "gradients and buckets" if term.term.startswith("deepspeed:") else None)
        if name is None:
            raise KeyError(f"planner term {term.term!r} has no segment in the builder's bar")
        segments[name]["mib"] += term.mib or 0.0
        segments[name]["terms"].append(term.term)
    return list(segments.values())

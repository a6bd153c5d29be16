"""The plan of a job typed as a command line: composed, checked and predicted, as `zerotune plan` and the builder
page ask for it, with the micro batch planned and where its value came from; `plan_all` ranks the options."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from zerotune.compose import compose_settled, value_setter
from zerotune.errors import ConfigError
from zerotune.plan import gpus, recommend
from zerotune.plan.predict import predict
from zerotune.platform import ANY_CUDA_GPU, Platform
from zerotune.preflight import check
from zerotune.resolved import ResolvedRun
from zerotune.rundir.plan import Plan
from zerotune.schema import Config
from zerotune.user_config.precedence import pinned_by, typed_keys

# What --all varies: ZeRO stage x offload x gradient checkpointing (NVMe offload is ZeRO-3's only).
OPTIONS = [(stage, offload, checkpointing) for stage in (0, 1, 2, 3) for offload in ("none", "cpu", "nvme")
           for checkpointing in (False, True) if offload != "nvme" or stage == 3]


_NO_LOCK = contextlib.nullcontext()  # reusable: it holds nothing


def plan_one(overrides: list[str], gpu: gpus.GPU | None,
             trace_lock: AbstractContextManager = _NO_LOCK, device: str = "cuda") -> Plan:
    """One job's prediction. `trace_lock` is held while it traces (the builder page's requests take turns).
    `device` cpu: the job as it runs on this machine's CPU accelerator (its own dict: torch's AdamW, no card)."""
    settled = compose_settled(overrides)
    plan = settled.config.plan
    gpu = None if device == "cpu" else gpu or gpus.lookup(plan.gpu, plan.gpu_mib)
    checked = check(settled, platform_for(gpu))
    with trace_lock:
        answer = predict(checked, gpu, device=device)
    return answer.adding(micro_batch=micro_batch(checked.config, checked, overrides))


BATCH_KEY = "train.batch_size"


def micro_batch(cfg: Config, checked: ResolvedRun, overrides: list[str]) -> dict:
    """The micro batch the plan is for, and where its value came from: {"value", "source" (command line,
    experiment, default config, option or file), "from" (in words), "file"}."""
    value = cfg.train.batch_size
    typed = typed_keys(list(overrides))
    origin = checked.config_sources.get("values", {}).get("train_micro_batch_size_per_gpu", "default")
    if origin == "command line":
        return {"value": value, "source": "command line", "from": f"the command line: {pinned_by(typed, BATCH_KEY)}",
                "file": None}
    if origin != "default":  # the user's DeepSpeed file: its micro batch, or its train_batch_size divided
        file = checked.config_sources.get("deepspeed_config_file")
        said = (f"{origin}, in {Path(file).name}" if origin.startswith("derived") and file
                else f"{origin}: train_micro_batch_size_per_gpu")
        return {"value": value, "source": "file", "from": said, "file": file}
    setter = value_setter(overrides, BATCH_KEY)
    if setter is None:
        return {"value": value, "source": "default config", "from": "the schema's default", "file": None}
    shown = _shown(setter.file)
    group, _, option = setter.config_path.partition("/")
    if group == "config":
        source, said = "default config", f"the default config ({shown})"
    elif group == "experiment":
        source, said = "experiment", f"experiment={option} ({shown})"
    elif pinned_by(typed, group):
        source, said = "option", f"{group}={option}, typed on the command line ({shown})"
    elif group in setter.chosen:  # an experiment's or another option's `override /group: option`
        by = f"experiment={setter.chosen['experiment']}" if "experiment" in setter.chosen else "another option"
        source, said = "option", f"{group}={option}, chosen by {by} ({shown})"
    else:
        source, said = "default config", f"the default config's {group}={option} ({shown})"
    return {"value": value, "source": source, "from": said, "file": str(setter.file)}


def _shown(file: Path) -> str:
    """A config file as a person finds it: relative to the working directory when under it."""
    relative = os.path.relpath(file)
    return str(file) if relative.startswith("..") else relative


def platform_for(gpu: gpus.GPU | None) -> Platform | None:
    """A plan for a named card is checked as a config for a CUDA card (Lion without offload needs its fused
    kernel, which this CPU machine lacks and the card has); with no card named, against this machine."""
    return ANY_CUDA_GPU if gpu is not None else None


def plan_all(overrides: list[str], gpu: gpus.GPU | None, plan: Callable[[list[str], gpus.GPU | None], Plan] = plan_one
             ) -> dict:
    """Every option in OPTIONS ranked; `plan` predicts one job (the builder page's takes its locks)."""
    rows = []
    for stage, offload, checkpointing in OPTIONS:
        option = [f"zero_stage={stage}", f"offload={offload}", f"train.gradient_checkpointing={checkpointing}"]
        try:
            rows.append(recommend.Row(stage, offload, checkpointing, plan([*overrides, *option], gpu)))
        except ConfigError as exc:
            rows.append(recommend.Row(stage, offload, checkpointing, None, refused=str(exc).splitlines()[0]))
    # The options vary stage, offload and checkpointing only: every one plans the same micro batch.
    batch = next((r.plan.micro_batch for r in rows if r.plan and "micro_batch" in r.plan), None)
    return {**recommend.rank(rows, gpu), "micro_batch": batch}

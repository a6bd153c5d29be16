"""`zerotune plan` and the builder page: a command line's job composed, checked and predicted (with its micro
batch's source), `plan_all`'s ranking of the options, and both as text."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from zerotune.config.compose import compose_settled, value_setter
from zerotune.config.errors import ConfigError
from zerotune.config.precedence import pinned_by, typed_keys
from zerotune.config.schema import Config
from zerotune.host.platform import ANY_CUDA_GPU, Platform
from zerotune.plan import gpus
from zerotune.plan import gpus as recommend
from zerotune.plan.predict import predict
from zerotune.plan.resolve import ResolvedRun, check
from zerotune.rundir.plan import PERSISTENT, Phase, Plan, Term

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
    resolved = check(settled, platform_for(gpu))
    with trace_lock:
        answer = predict(resolved, gpu, device=device)
    return answer.adding(micro_batch=micro_batch(resolved.config, resolved, overrides))


BATCH_KEY = "train.batch_size"


def micro_batch(cfg: Config, resolved: ResolvedRun, overrides: list[str]) -> dict:
    """The micro batch the plan is for, and where its value came from: {"value", "source" (command line,
    experiment, default config, option or file), "from" (in words), "file"}."""
    value = cfg.train.batch_size
    typed = typed_keys(list(overrides))
    origin = resolved.config_sources.get("values", {}).get("train_micro_batch_size_per_gpu", "default")
    if origin == "command line":
        return {"value": value, "source": "command line", "from": f"the command line: {pinned_by(typed, BATCH_KEY)}",
                "file": None}
    if origin != "default":  # the user's DeepSpeed file: its micro batch, or its train_batch_size divided
        file = resolved.config_sources.get("deepspeed_config_file")
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
    return {**recommend.rank(rows, gpu, host_budget(overrides)), "micro_batch": batch}


def host_budget(overrides: list[str]) -> float | None:
    """plan.host_mib as the overrides set it (None: not given)."""
    budget = compose_settled(overrides).config.plan.host_mib
    return float(budget) if budget is not None else None


def _terms(terms: Sequence[Term], unit: str = "MiB") -> list[str]:
    width = max((len(t.term) for t in terms), default=0)
    out = []
    for t in terms:
        figure = t.mib if unit == "MiB" else t.seconds
        value = "unmeasured" if figure is None else (f"{figure:>10,.1f} MiB" if unit == "MiB" else f"{figure:>10.4f} s")
        when = f"[{t.moment}] " if t.held_in != PERSISTENT else ""
        out.append(f"  {t.term:<{width}}  {value}  {when}{t.note}".rstrip())
    return out


def _device(plan: Plan) -> list[str]:
    """The step's peak on the device: held throughout, plus the largest moment's terms ([moment])."""
    moment = plan.step_peak_moment
    if plan.device == "cpu":
        return [f"the step on this CPU (one rank, what torch allocates; host memory): {plan.step_peak_mib:,.1f} MiB "
                f"at its largest moment, {moment}", *_terms(plan.step_terms)]
    gpu = plan.gpu
    card = f"{gpu['name']} ({gpu['memory_mib']:,} MiB)" if gpu else "no GPU named (--gpu NAME or --gpu-mib N)"
    verdict = {True: "fits", False: "does NOT fit", None: "-"}[plan.fits]
    return [f"GPU peak per rank: {plan.peak_mib:,.1f} MiB (the run's, in "
            f"{plan.run_peak_phase or 'step'}) on {card}: {verdict}",
            f"the step: {plan.gpu_peak_mib:,.1f} MiB at its largest moment, {moment}", *_terms(plan.gpu_terms)]


def _host(plan: Plan) -> list[str]:
    """The host terms; on a CPU plan, the processes' RSS it predicts (plan/host_memory.py) and how."""
    process = plan.host_process_terms
    if not process:
        return _terms(plan.host_terms)
    return [f"  the job's processes (RSS): {process.source}", *("  " + line for line in _terms(process.terms)),
            "  of which tensors, and the fp32 build at load time:", *("  " + line for line in _terms(plan.host_terms))]


def micro_batch_lines(found: dict | None) -> list[str]:
    """Which micro batch was planned and where its value came from; how to plan another, unless it was typed
    or a file of the user's gives it (there, the command line may not contradict it)."""
    if not found:
        return []
    hint = "" if found["source"] in ("command line", "file") else "; train.batch_size=N plans another"
    return [f"micro batch: {found['value']} per rank, from {found['from']}{hint}"]


def breakdown(plan: Plan) -> str:
    lines = [f"workload: {plan.workload}", *micro_batch_lines(plan.micro_batch), *_device(plan),
             f"host peak (all {plan.world_size} ranks): {plan.host_peak_mib:,.1f} MiB", *_host(plan),
             f"NVMe: {plan.nvme_mib:,.1f} MiB", *_terms(plan.nvme_terms)]
    floor = plan.time_floor_s
    lines.append("time per step: " + ("unmeasured (no GPU figures)" if floor is None else
                                      f"at least {floor:.4f} s ({plan.bound}-bound floor)"))
    lines += _terms(plan.time_terms, unit="s")
    lines += phases(list(plan.phases))
    return "\n".join(lines)


def phases(found: list[Phase]) -> list[str]:
    """The run's phases (plan/phases.py), in run order: what nvidia-smi shows during each, its own peak, what
    earlier phases left reserved, and its terms; [] for a plan without them."""
    if not found:
        return []
    top = max(found, key=lambda p: p.reserved_mib)
    lines = [f"the run's phases (nvidia-smi during each; a freed block stays reserved until empty_cache): "
             f"peak {top.reserved_mib:,.1f} MiB in {top.phase}"]
    for p in found:
        mark = "  <- the run's peak" if p is top else ""
        lines.append(f" {p.phase}: {p.reserved_mib:,.1f} MiB reserved (own peak {p.peak_mib:,.1f}, "
                     f"{p.carried_mib:,.1f} left by earlier phases){mark}")
        lines += ["  " + line for line in _terms(p.terms)]
        lines.append(f"    source: {p.source}")
    return lines


def ranking(answer: dict) -> str:
    rows = [*micro_batch_lines(answer.get("micro_batch")),
            f"{'option':<62} {'fits':>5} {'GPU MiB':>10} {'step MiB':>10} {'host MiB':>10} {'NVMe MiB':>9} {'floor s':>8}"]
    for r in answer["options"]:
        if r.get("refused"):
            rows.append(f"{r['option']:<62} {'-':>5}  refused: {r['refused']}")
            continue
        floor = "-" if r["time_floor_s"] is None else f"{r['time_floor_s']:.3f}"
        fits = {True: "yes", False: "no", None: "-"}[r["fits"]]
        rows.append(f"{r['option']:<62} {fits:>5} {r['peak_mib']:>10,.0f} {r['gpu_peak_mib']:>10,.0f} {r['host_peak_mib']:>10,.0f} "
                    f"{r['nvme_mib']:>9,.0f} {floor:>8}")
    rows.append("GPU MiB: the run's peak as nvidia-smi shows it (its phases); step MiB: the training step's alone")
    rec = answer["recommended"]
    rows.append(f"recommended: {rec['option'] or 'none'} ({rec['why']})")
    least = answer.get("smallest") or {}
    if least.get("option"):
        floor = least["time_floor_s"]
        rows.append(f"smallest peak: {least['option']} ({least['peak_mib']:,.0f} MiB"
                    + (f", time floor {floor:.3f} s/step)" if floor is not None else ")"))
    return "\n".join(rows)

"""The planner in a job's life: its prediction in every summary.json (plan.*), plan.only jobs that
predict without training, and the guard that acts on a predicted peak above the memory there is: a present
GPU's free memory, and this host's available memory (on a CPU accelerator the device's memory is host memory)."""

from __future__ import annotations

import logging
from typing import Any

from zerotune.config import search as config_search
from zerotune.config.errors import ConfigError
from zerotune.config.schema import MIB, Config
from zerotune.config.schema import Plan as PlanSettings
from zerotune.host.platform import detect
from zerotune.host.ram import read_host_memory
from zerotune.plan import gpus
from zerotune.plan.host_memory import PROCESS_RSS, largest_share, node_need_mib
from zerotune.plan.predict import predict
from zerotune.plan.resolve import ResolvedRun
from zerotune.rundir.plan import Plan
from zerotune.rundir.summary import Status

log = logging.getLogger("zerotune")

GUARDS = ("warn", "refuse", "skip")
_NAMES = (("rtx 3090", "rtx3090"), ("rtx 4090", "rtx4090"), ("l40s", "l40s"), ("l4", "l4"), ("h200", "h200"),
          ("h100", "h100"))


def present_gpu() -> gpus.GPU | None:
    """The card this process would train on, as the catalog knows it (else by its memory alone)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name, total = torch.cuda.get_device_name().lower(), torch.cuda.get_device_properties(0).total_memory // MIB
    for part, known in _NAMES:
        if part in name:
            return gpus.CATALOG[known]
    if "a100" in name:
        return gpus.CATALOG["a100-80" if total > 50_000 else "a100-40"]
    return gpus.lookup(None, int(total))


def job_gpu(cfg: Config) -> gpus.GPU | None:
    """plan.gpu / plan.gpu_mib when given (a bad name is a config error), else the card present."""
    check_plan_keys(cfg.plan)
    named = gpus.lookup(cfg.plan.gpu, cfg.plan.gpu_mib)
    return named or present_gpu()


def check_plan_keys(plan: PlanSettings) -> None:
    if plan.guard not in GUARDS:
        raise ConfigError("plan.guard", f"unknown {plan.guard!r}", f"plan.guard={' | '.join(GUARDS)}")
    budget = plan.host_mib
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ConfigError("plan.host_mib", f"must be a positive number of MiB, got {budget!r}",
                          "e.g. plan.host_mib=16384, or plan.host_mib=null for what this host has available")


def job_plan(resolved: ResolvedRun, gpu: gpus.GPU | None) -> Plan:
    """The job's prediction with this host's fit (`host_fit`); a planner failure is recorded, never fatal."""
    # A CPU run with no card named: the step as it runs here, and what its processes hold (plan/host_memory.py).
    cfg, device = resolved.config, "cpu" if gpu is None and detect().device_type == "cpu" else "cuda"
    try:
        plan = predict(resolved, gpu, device=device)
    except Exception as exc:  # noqa: BLE001 (the run itself does not depend on the prediction)
        log.warning("the memory planner failed: %s: %s", type(exc).__name__, exc)
        return Plan.made(error=f"{type(exc).__name__}: {exc}"[:500])
    if not (cfg.plan.only and (cfg.plan.gpu or cfg.plan.gpu_mib)):  # a plan for a named card is not this host's
        plan = plan.adding(host_fit=host_fit(cfg, plan))
    return plan


def host_fit(cfg: Config, plan: Plan) -> dict[str, Any]:
    """The node's predicted need of host memory beside what this host (its cgroup, plan.host_mib) has for it."""
    accelerator, ranks = detect().device_type, cfg.launch.num_processes
    # A CPU plan's host figure is the node's whole process RSS (imports included: plan/host_memory.py), not its tensors.
    need = plan.host_peak_mib if plan.host_peak_kind == PROCESS_RSS else node_need_mib(plan, ranks, accelerator)
    memory, budget = read_host_memory(), cfg.plan.host_mib
    room = memory.headroom_mib if budget is None else min(memory.headroom_mib, float(budget))
    return {"accelerator": accelerator, "ranks": ranks, "needed_mib": need, "available_mib": memory.headroom_mib,
            "total_mib": memory.total_mib, "cgroup_limit_mib": memory.cgroup_limit_mib, "budget_mib": budget,
            "room_mib": room, "fits": None if need is None else need <= room}


def guard(cfg: Config, plan: Plan) -> Status | None:
    """Warn, refuse (ConfigError) or skip (return Status.PREDICTED_OOM) where the predicted peak is above a CUDA
    device's free memory or the host's available memory (plan.host_fit; device terms too on a CPU accelerator)."""
    problems = memory_problems(plan)
    if not problems:
        return None
    problem = "; and ".join(problems)
    if cfg.plan.guard == "refuse":
        raise ConfigError("plan.guard", problem, _fixes(cfg, plan))
    log.warning("%s (plan.guard=%s)", problem, cfg.plan.guard)
    return Status.PREDICTED_OOM if cfg.plan.guard == "skip" else None


def memory_problems(plan: Plan) -> list[str]:
    """Each memory the predicted peak is above: a present GPU's free memory, this host's available memory."""
    if "gpu_peak_mib" not in plan:
        return []
    return [p for p in (_cuda_problem(plan), _host_problem(plan.host_fit)) if p]


def _cuda_problem(plan: Plan) -> str | None:
    import torch

    if not torch.cuda.is_available() or plan.gpu_peak_mib is None:
        return None
    free_mib = torch.cuda.mem_get_info()[0] / MIB
    if plan.gpu_peak_mib <= free_mib:
        return None
    return f"predicted GPU peak {plan.gpu_peak_mib:,.0f} MiB is above the {free_mib:,.0f} MiB free on this GPU"


def _host_problem(fit: dict | None) -> str | None:
    if not fit or fit["fits"] is not False:
        return None
    what = ("host memory (on a CPU accelerator the device's memory is host memory)" if fit["accelerator"] == "cpu"
            else "host memory (offloaded states, the fp32 build of the U-Net)")
    budget = fit["budget_mib"]
    if budget is not None and budget <= fit["available_mib"]:
        room = f"the {budget:,.0f} MiB plan.host_mib gives the job"
    elif fit["cgroup_limit_mib"] is not None:
        room = f"the {fit['available_mib']:,.0f} MiB available (cgroup limit {fit['cgroup_limit_mib']:,.0f} MiB)"
    else:
        room = f"the {fit['available_mib']:,.0f} MiB available on this host ({fit['total_mib']:,.0f} MiB in all)"
    return (f"predicted peak {fit['needed_mib']:,.0f} MiB of {what} for this node's {fit['ranks']} rank(s) "
            f"is above {room}")


def _fixes(cfg: Config, plan: Plan) -> str:
    """The overrides that bring the prediction under the memory there is, the largest terms' remedies first."""
    fixes = []
    fit = plan.host_fit or {}
    if fit.get("fits") is False:
        states, activations = largest_share(plan, fit["accelerator"])
        if fit["ranks"] > 1:
            fixes.append("launch.num_processes=1 (each rank holds its own copy)")
        if states >= 0.5 and _option(cfg, "adapter") in (None, "none"):
            fixes.append("adapter=lora (trains an adapter, the U-Net frozen)")
        if _option(cfg, "offload", "device") != "nvme":
            fixes.append("zero_stage=3 offload=nvme offload.path=<folder> (parameters and optimizer states on a "
                         "fast disk; its own buffers stay in memory: see its plan with plan.only=true first)")
        if activations >= 0.25:
            fixes.append(f"a lower resolution or train.batch_size (activations are {activations:.0%} of the peak)")
    else:
        fixes.append("zerotune plan ... --all for options that fit")
    fixes += [f"model={name}" for name in _smaller_models(cfg, plan, fit)]
    fixes += ["plan.only=true to predict without training", "plan.guard=warn to run anyway"]
    return "; or ".join(fixes)


def _smaller_models(cfg: Config, plan: Plan, fit: dict[str, Any]) -> list[str]:
    """Smaller model options whose need (this plan's scaled by parameter count: an estimate) fits the room: the
    host's where the host is short, else the card's. None where the run names weights or components."""
    from zerotune.models import load_option, model_stats

    model, search = _option(cfg, "model"), config_search.current()
    current = (plan.trainable_params or 0) + (plan.frozen_params or 0)
    if not model or not current or _option(cfg, "model", "pretrained") or _option(cfg, "model", "components"):
        return []
    if fit.get("fits") is False:
        need, room = fit.get("needed_mib"), fit.get("room_mib")
    else:
        need, room = plan.gpu_peak_mib, (plan.gpu or {}).get("memory_mib")
    found = []
    for name in search.group_options().get("model", []):
        path = search.option_file("model", name)
        if name == model or path is None:
            continue
        params = model_stats(load_option(path)).num_params
        if params < current and (need is None or room is None or need * params / current <= room):
            found.append(name)
    return found


def _option(cfg: Config, group: str, key: str = "name") -> Any:
    """A group's chosen option (its `name`, or `key`), None where the config leaves the group out."""
    return getattr(getattr(cfg, group, None), key, None)

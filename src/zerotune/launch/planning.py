"""The planner in a job's life: its prediction in every summary.json (plan.*), plan.only jobs that
predict without training, and the guard that acts on a predicted peak above a present GPU's free memory."""

from __future__ import annotations

import logging
from typing import Any

from zerotune.errors import ConfigError
from zerotune.plan import gpus
from zerotune.plan.predict import predict
from zerotune.preflight import CheckedRun

log = logging.getLogger("zerotune")

GUARDS = ("warn", "refuse", "skip")
_NAMES = (("rtx 3090", "rtx3090"), ("rtx 4090", "rtx4090"), ("l40s", "l40s"), ("l4", "l4"), ("h200", "h200"),
          ("h100", "h100"))


def present_gpu() -> gpus.GPU | None:
    """The card this process would train on, as the catalog knows it (else by its memory alone)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name, total = torch.cuda.get_device_name().lower(), torch.cuda.get_device_properties(0).total_memory // 2**20
    for part, known in _NAMES:
        if part in name:
            return gpus.CATALOG[known]
    if "a100" in name:
        return gpus.CATALOG["a100-80" if total > 50_000 else "a100-40"]
    return gpus.lookup(None, int(total))


def job_gpu(cfg: Any) -> gpus.GPU | None:
    """plan.gpu / plan.gpu_mib when given (a bad name is a config error), else the card present."""
    if cfg.plan.guard not in GUARDS:
        raise ConfigError("plan.guard", f"unknown {cfg.plan.guard!r}", f"plan.guard={' | '.join(GUARDS)}")
    named = gpus.lookup(cfg.plan.gpu, cfg.plan.gpu_mib)
    return named or present_gpu()


def job_plan(cfg: Any, checked: CheckedRun, gpu: gpus.GPU | None) -> dict:
    """The job's prediction for its summary; a planner failure is recorded, never stops a run."""
    try:
        return predict(cfg, checked, gpu)
    except Exception as exc:  # noqa: BLE001 (the run itself does not depend on the prediction)
        log.warning("the memory planner failed: %s: %s", type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def guard(cfg: Any, plan: dict) -> str | None:
    """On a CUDA device: a predicted peak above its free memory warns, refuses (ConfigError) or skips the
    job (returns "predicted_oom"). Elsewhere there is nothing to guard."""
    import torch

    if "gpu_peak_mib" not in plan or not torch.cuda.is_available():
        return None
    free_mib = torch.cuda.mem_get_info()[0] / 2**20
    if plan["gpu_peak_mib"] <= free_mib:
        return None
    problem = f"predicted GPU peak {plan['gpu_peak_mib']:,.0f} MiB is above the {free_mib:,.0f} MiB free on this GPU"
    if cfg.plan.guard == "refuse":
        raise ConfigError("plan.guard", problem, "python -m zerotune.plan ... --all for options that fit, or "
                          "plan.guard=warn to run anyway")
    log.warning("%s (plan.guard=%s)", problem, cfg.plan.guard)
    return "predicted_oom" if cfg.plan.guard == "skip" else None

"""summary.json's `validation`: the passes, and the sampling phase the planner predicted beside the one measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerotune.training.trainer import Trainer

def validation_record(trainer: Trainer, plan: dict[str, Any] | None, phases: Sequence[dict]) -> dict | None:
    """None for a run without validation prompts."""
    if trainer.validation_error is not None:
        return {"error": trainer.validation_error, "passes": []}
    if trainer.validator is None:
        return None
    from zerotune.plan.phases import validation_pass_terms

    found = validation_pass_terms(trainer.cfg, trainer.run)
    added = found[0] if found is not None else None
    return {**trainer.validator.summary(), "memory": phase_memory(plan, phases, added)}


def phase_memory(plan: dict[str, Any] | None, phases: Sequence[dict], added: list[dict] | None) -> dict:
    """The planner's sampling phase and the largest measured pass. On a CUDA device the allocator's reserved peak
    during the passes is what the planned reserved figure predicts; on a CPU there is no device figure (None,
    unmeasured), and the host RSS rise over the training steps' peak stands beside the terms the pass adds
    (`added`: plan/phases.py validation_pass_terms, computed on any device)."""
    planned = next((p for p in (plan or {}).get("phases") or [] if p.get("phase") == "sampling"), None)
    passes = [r for r in phases if r.get("phase") == "sampling"]
    steps = [r for r in phases if r.get("phase") == "step"]
    reserved = _largest(passes, "gpu_max_reserved_mib")
    host, step_host = _largest(passes, "host_peak_rss_mib"), _largest(steps, "host_peak_rss_mib")
    out = {"planned_reserved_mib": planned.get("reserved_mib") if planned else None,
           "planned_pass_mib": sum(t["mib"] for t in added) if added is not None else None,
           "planned_pass_terms": {t["term"]: t["mib"] for t in added or []},
           "measured_gpu_max_reserved_mib": reserved,
           "measured_gpu_max_allocated_mib": _largest(passes, "gpu_max_allocated_mib"),
           "measured_host_peak_rss_mib": host, "steps_host_peak_rss_mib": step_host,
           "host_rss_rise_mib": host - step_host if host is not None and step_host is not None else None}
    out["gpu_measured_over_planned"] = (reserved / out["planned_reserved_mib"]
                                        if reserved is not None and out["planned_reserved_mib"] else None)
    return out


def _largest(records: Sequence[dict], key: str) -> float | None:
    known = [r[key] for r in records if r.get(key) is not None]
    return max(known) if known else None

"""Before any trial: each candidate composed, checked by the validator and planned. What the validator refuses,
what the planner predicts will not fit, and what composes to the same run as an earlier candidate are dropped,
each with its reason; the rest are the trials."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from zerotune.compose.settle import Settled
from zerotune.errors import ConfigError
from zerotune.rundir.plan import Plan
from zerotune.rundir.status import Status
from zerotune.schema import Config, as_dict
from zerotune.tune.space import Candidate

KEPT, INVALID, SAME, SLOWER = "kept", "invalid", "duplicate", "dominated"
NO_FIT = Status.PREDICTED_OOM  # the word a job the guard skipped records: the tune report's column shows both
CHECKPOINTING = "train.gradient_checkpointing"


@dataclass
class Screened:
    number: int                       # the candidate's place in the space, from 0
    candidate: Candidate
    verdict: str                      # kept | invalid | predicted_oom | duplicate | dominated
    reason: str = ""
    plan: dict = field(default_factory=dict)   # peak MiB, time floor and what binds it


def screen(found: list[Candidate], workload: list[str], settle: Callable[[list[str]], Settled],
           gpu_name: str | None) -> list[Screened]:
    """Each candidate's verdict. `settle`: overrides -> the job's settled config; `gpu_name`: plan for that card
    (not present) rather than this machine."""
    from zerotune.plan import gpus
    from zerotune.plan.guard import job_gpu, job_plan
    from zerotune.preflight import check

    out: list[Screened] = []
    runs: dict[str, int] = {}  # a resolved config (_run_key): the first candidate that runs it
    for number, candidate in enumerate(found):
        overrides = [*workload, *candidate.overrides()]
        try:
            run = check(settle(overrides))
            gpu = gpus.lookup(gpu_name, None) if gpu_name else job_gpu(run.config)
            plan = job_plan(run, gpu)
        except ConfigError as exc:
            out.append(Screened(number, candidate, INVALID, f"{exc.key}: {exc.problem} (fix: {exc.fix})"))
            continue
        same = runs.setdefault(_run_key(run.config), number)
        problems = [] if "error" in plan else _problems(plan, gpu_name)
        verdict, reason = ((SAME, f"the same run as candidate {same}") if same != number else
                           (NO_FIT, "; ".join(problems)) if problems else (KEPT, plan.error or ""))
        out.append(Screened(number, candidate, verdict, reason, _plan_view(plan)))
    return _drop_needless_checkpointing(out)


def _drop_needless_checkpointing(found: list[Screened]) -> list[Screened]:
    """Gradient checkpointing only adds a forward's recomputation: it is worth a trial only where the same run
    without it is predicted not to fit."""
    without = {_twin_key(s.candidate): s for s in found if str(s.candidate.knobs.get(CHECKPOINTING)).lower() == "false"}
    for s in found:
        twin = without.get(_twin_key(s.candidate))
        if s.verdict == KEPT and str(s.candidate.knobs.get(CHECKPOINTING)).lower() == "true" and twin is not None \
                and twin.verdict == KEPT:
            s.verdict = SLOWER
            s.reason = (f"candidate {twin.number}, the same without gradient checkpointing, is predicted to fit; "
                        "checkpointing only adds recomputation")
    return found


def _twin_key(candidate: Candidate) -> str:
    return " ".join(f"{k}={v}" for k, v in candidate.knobs.items() if k != CHECKPOINTING)


def _problems(plan: Plan, gpu_name: str | None) -> list[str]:
    from zerotune.plan.guard import memory_problems

    if gpu_name:  # a card not here: its whole memory, as the catalog gives it
        return [] if plan.fits is not False else [
            f"predicted GPU peak {plan.run_peak_mib or plan.gpu_peak_mib:,.0f} MiB is above the "
            f"{gpu_name}'s memory"]
    return memory_problems(plan)


def _run_key(cfg: Config) -> str:
    """Two candidates that resolve to the same config (zero_stage=2 and zero_stage='2') are one run."""
    return json.dumps(as_dict(cfg), sort_keys=True, default=str)


def planned_peak_mib(plan: dict) -> float | None:
    """A screened candidate's predicted peak: the run's, else the GPU's, else the step's."""
    return plan.get("run_peak_mib") or plan.get("gpu_peak_mib") or plan.get("step_peak_mib")


def _plan_view(plan: Plan) -> dict:
    view = {k: getattr(plan, k) for k in ("gpu_peak_mib", "run_peak_mib", "host_peak_mib", "step_peak_mib",
                                          "time_floor_s", "bound")}
    view["host_need_mib"] = (plan.host_fit or {}).get("needed_mib")
    terms = plan.time_terms
    view["terms"] = {t.term: t.seconds for t in terms if t.seconds is not None}
    view["terms_unknown"] = [f"{t.term} ({t.note or 'unmeasured'})" for t in terms if t.seconds is None]
    return view

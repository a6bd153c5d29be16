"""Which configuration to pick: the fastest one whose measured peak memory fits a budget."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from zerotune.report.collect import MEMORY_KEYS, OVERRIDE_TO_CHOICE, sort_key, swept_keys

# What `--metric gpu|host` means.
METRICS = {"gpu": "gpu_peak_process_mib", "host": "host_peak_rss_mib"}
# Median step times within this fraction of the fastest count as a tie: run-to-run noise is about that big.
TIE_REL = 0.02
TIME_KEY = "step_time_median_s"
# Keys that change the work a step does: seconds per step only compare between jobs that agree on them.
WORKLOAD_KEYS = ("resolution", "batch_size", "grad_accum", "model", "data")


@dataclass(frozen=True)
class BudgetAnswer:
    best: dict | None          # the chosen row, or None (then `reason` says why)
    reason: str                # one paragraph for a person
    metric: str
    budget_mib: float
    ties: list[dict] = field(default_factory=list)  # rows as fast as `best` (within TIE_REL) that fit too


def resolve_metric(metric: str) -> str:
    """'gpu' / 'host' or a memory key from summary.json, as the memory key."""
    key = METRICS.get(metric, metric)
    if key not in MEMORY_KEYS:
        raise ValueError(f"unknown memory metric {metric!r}: use gpu, host or one of "
                         f"{', '.join(MEMORY_KEYS)}")
    return key


def cheapest_fit(rows: list[dict], budget_mib: float, metric: str = "gpu_peak_process_mib",
                 where: dict[str, Any] | None = None) -> dict | None:
    """The fastest ok row whose measured peak `metric` fits `budget_mib`, as a copy with a `fit` entry
    (metric, budget_mib, peak_mib, headroom_mib, reason, ties); None when nothing fits or nothing was
    measured -- `budget_answer` gives the reason then. `where` ({"resolution": 512}) keeps only the jobs
    with those values, so step times compare like with like."""
    answer = budget_answer(rows, budget_mib, metric, where)
    if answer.best is None:
        return None
    peak = answer.best[answer.metric]
    fit = {"metric": answer.metric, "budget_mib": answer.budget_mib, "peak_mib": peak,
           "headroom_mib": answer.budget_mib - peak, "reason": answer.reason,
           "ties": [(t["sweep_dir"], t["job"]) for t in answer.ties]}
    return {**answer.best, "fit": fit}


def budget_answer(rows: list[dict], budget_mib: float, metric: str = "gpu_peak_process_mib",
                  where: dict[str, Any] | None = None) -> BudgetAnswer:
    key = resolve_metric(metric)
    if not math.isfinite(budget_mib) or budget_mib <= 0:
        raise ValueError(f"budget must be a positive number of MiB, got {budget_mib}")
    keys = swept_keys(rows) if rows else []
    where = {OVERRIDE_TO_CHOICE.get(k, k): v for k, v in (where or {}).items()}
    scope = f"Among jobs with {_pairs(where)}: " if where else ""
    rows = [r for r in rows if all(_same(r["params"].get(k), v) for k, v in where.items())]
    keys = [k for k in keys if k not in where]
    if where and not rows:
        return BudgetAnswer(None, f"No job has {_pairs(where)}.", key, budget_mib)
    found = _fitting(rows, key, budget_mib, keys)
    if isinstance(found, str):  # no candidate: the reason why
        return BudgetAnswer(None, scope + found, key, budget_mib)
    best, ties, reason = _fastest(found, key, budget_mib, keys)
    if best is None:
        return BudgetAnswer(None, scope + reason, key, budget_mib)
    return BudgetAnswer(best, scope + reason + found.notes, key, budget_mib, ties)


@dataclass
class _Fits:
    rows: list[dict]     # ok jobs whose measured peak fits the budget
    measured: int        # ok jobs with a figure for the metric
    notes: str           # what was left out, and why


def _fitting(rows: list[dict], key: str, budget_mib: float, keys: list[str]) -> _Fits | str:
    """The jobs that fit, or why none can."""
    ok = [r for r in rows if r["status"] == "ok"]
    not_ok = _status_counts([r for r in rows if r["status"] != "ok"])
    not_ok_note = f" Did not finish ok: {not_ok}." if not_ok else ""
    if not ok:
        return f"No job finished with status ok ({not_ok or 'no jobs'}), so nothing can be recommended."
    measured = [r for r in ok if r[key] is not None]
    if not measured:
        if key.startswith("gpu_"):
            return (f"Could not decide from GPU figures: {key} was not measured in any of the {len(ok)} ok jobs "
                    "(no GPU present). For a host-RAM budget ask for it explicitly (--metric host).")
        return f"{key} was not measured in any of the {len(ok)} ok jobs."
    unmeasured = len(ok) - len(measured)
    skipped = f" {unmeasured} ok job(s) have no {key} figure and were not considered." if unmeasured else ""
    fits = [r for r in measured if r[key] <= budget_mib]
    if not fits:
        low = min(measured, key=lambda r: r[key])
        return (f"Nothing fits {budget_mib:.0f} MiB of {key}: the smallest measured peak is {low[key]:.0f} MiB "
                f"({describe(low, keys)}).{skipped}{not_ok_note}")
    return _Fits(fits, len(measured), skipped + not_ok_note)


def _fastest(found: _Fits, key: str, budget_mib: float, keys: list[str]) -> tuple[dict | None, list, str]:
    """The fastest fitting job; among the equally fast (within TIE_REL) the smaller peak wins: more headroom
    for the same speed. Then the faster, then a stable configuration order."""
    fits = found.rows
    timed = [r for r in fits if r[TIME_KEY] is not None]
    if not timed:
        return None, [], (f"{len(fits)} job(s) fit {budget_mib:.0f} MiB but none has a median step time "
                          "(too few steps were timed), so none can be called fastest.")
    fastest = min(r[TIME_KEY] for r in timed)
    tied = sorted((r for r in timed if r[TIME_KEY] <= fastest * (1 + TIE_REL)),
                  key=lambda r: (r[key], r[TIME_KEY], [sort_key(r["params"].get(k)) for k in keys]))
    best, ties = tied[0], tied[1:]
    reason = (f"Fastest that fits {budget_mib:.0f} MiB of {key}: {describe(best, keys)} at "
              f"{best[TIME_KEY]:.3g} s/step (median), peak {best[key]:.0f} MiB, "
              f"{budget_mib - best[key]:.0f} MiB headroom. {len(fits)} of {found.measured} measured ok job(s) "
              "fit.")
    if ties:
        names = "; ".join(f"{describe(t, keys)} ({t[TIME_KEY]:.3g} s/step, {t[key]:.0f} MiB)" for t in ties)
        reason += (f" Tied within {TIE_REL:.0%} on step time with: {names}; picked the one with the lowest "
                   "peak memory.")
    return best, ties, reason + _mixed_workload_note(fits, best)


def _mixed_workload_note(fits: list[dict], best: dict) -> str:
    mixed = [k for k in WORKLOAD_KEYS if len({repr(r["params"].get(k)) for r in fits}) > 1]
    if not mixed:
        return ""
    example = f"{mixed[0]}={best['params'][mixed[0]]}"
    return (f" Note: the jobs that fit differ in {', '.join(mixed)}, so their step times are for different "
            f"work; compare like with like with --where (e.g. --where {example}).")


def describe(row: dict, keys: list[str]) -> str:
    """`zero_stage=2, offload=cpu (job 3)` -- the swept values that name the configuration."""
    values = ", ".join(f"{k}={row['params'].get(k)}" for k in keys)
    return f"{values} (job {row['job']})" if values else f"job {row['job']}"


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def _same(value: Any, wanted: Any) -> bool:
    # 512 from the summary equals "512" typed on a command line.
    return value == wanted or (value is not None and str(value) == str(wanted))


def _status_counts(rows: list[dict]) -> str:
    """`2 oom, 1 failed` (empty for no rows)."""
    return ", ".join(f"{n} {s}" for s, n in sorted(Counter(r["status"] for r in rows).items()))

"""Which configuration to pick: the fastest one whose measured peak memory fits a budget; where measured figures give
no answer, the planner's predictions do. Its time floor is a lower bound, never set against a measured median: a
predicted job that might be faster than the measured choice is named, not chosen."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zerotune.report.collect import (
    MEMORY_KEYS,
    OVERRIDE_TO_CHOICE,
    PLAN_TIME_KEY,
    PREDICTED_FOR,
    sort_key,
    status_counts,
    swept_keys,
)
from zerotune.rundir.summary import Status

# What `--metric gpu|host` means.
METRICS = {"gpu": "gpu_peak_process_mib", "host": "host_peak_rss_mib"}
# Median step times within this fraction of the fastest count as a tie: run-to-run noise is about that big.
TIE_REL = 0.02
TIME_KEY = "step_time_median_s"
# Keys that change the work a step does: seconds per step only compare between jobs that agree on them
# (an adapter's step computes no weight gradients for the frozen base).
WORKLOAD_KEYS = ("resolution", "batch_size", "grad_accum", "model", "adapter", "data")


@dataclass(frozen=True)
class _Source:
    """Where a row's figures come from, and how the answer words them."""
    name: str         # "measured" | "predicted": the `source` of cheapest_fit's `fit`
    time_key: str     # the row key of seconds per step
    by: str           # after "fits N MiB of <metric>"
    time_words: str   # after "at <t>"
    time_name: str    # what the tie is on
    peak_words: str
    jobs_words: str   # after "<n> of <m>"
    untimed: str      # why none can be called fastest, given n and budget


MEASURED = _Source("measured", TIME_KEY, "", "s/step (median)", "step time", "peak", "measured ok job(s) fit.",
                   "{n} job(s) fit {budget:.0f} MiB but none has a median step time (too few steps were timed), "
                   "so none can be called fastest.")
# A planned job was never run, and a CPU-only run measured no GPU: the planner's figures are all they have.
# Speed is then the planner's time floor, a lower bound: never compared with a measured median.
PREDICTED = _Source("predicted", PLAN_TIME_KEY, " by predicted figures (the planner's, not measured)",
                    "s/step time floor (a lower bound from the planner, not a measurement)", "time floor",
                    "predicted peak", "job(s) with only predicted figures fit.",
                    "{n} job(s) fit {budget:.0f} MiB by predicted figures but the planner gave none a time floor, "
                    "so none can be called fastest.")
PREDICTED_STATUSES = (Status.OK, Status.PLANNED)


@dataclass(frozen=True)
class BudgetAnswer:
    best: dict | None          # the chosen row, or None (then `reason` says why)
    reason: str                # one paragraph for a person
    metric: str
    budget_mib: float
    ties: list[dict] = field(default_factory=list)  # rows as fast as `best` (within TIE_REL) that fit too
    source: str = "measured"   # "predicted" when `best` was chosen on the planner's figures

    @property
    def peak_key(self) -> str:
        """The row key of `best`'s figure for the metric."""
        return PREDICTED_FOR[self.metric] if self.source == PREDICTED.name else self.metric


def resolve_metric(metric: str) -> str:
    """'gpu' / 'host' or a memory key from summary.json, as the memory key."""
    key = METRICS.get(metric, metric)
    if key not in MEMORY_KEYS:
        raise ValueError(f"unknown memory metric {metric!r}: use gpu, host or one of "
                         f"{', '.join(MEMORY_KEYS)}")
    return key


def cheapest_fit(rows: list[dict], budget_mib: float, metric: str = "gpu_peak_process_mib",
                 where: dict[str, Any] | None = None) -> dict | None:
    """The fastest row whose peak `metric` fits `budget_mib`, as a copy with a `fit` entry (metric, budget_mib,
    peak_mib, headroom_mib, source, reason, ties); None when nothing fits or nothing was measured or predicted
    (`budget_answer` says why). `source` is "predicted" where the planner's figures decided. `where`
    ({"resolution": 512}) keeps only the jobs with those values, so step times compare like with like."""
    answer = budget_answer(rows, budget_mib, metric, where)
    if answer.best is None:
        return None
    peak = answer.best[answer.peak_key]
    fit = {"metric": answer.metric, "budget_mib": answer.budget_mib, "peak_mib": peak,
           "headroom_mib": answer.budget_mib - peak, "source": answer.source, "reason": answer.reason,
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
        return _from_predictions(rows, key, budget_mib, keys, scope, found)
    best, ties, reason = _fastest(found, key, budget_mib, keys)
    if best is None:
        return _from_predictions(rows, key, budget_mib, keys, scope, reason)
    notes = found.notes + _predicted_not_compared(rows, key, budget_mib, keys, best)
    return BudgetAnswer(best, scope + reason + notes, key, budget_mib, ties)


@dataclass
class _Fits:
    rows: list[dict]     # candidate jobs whose peak fits the budget
    measured: int        # candidate jobs with a figure for the metric
    notes: str           # what was left out, and why
    peak: str            # the row key compared with the budget
    source: _Source = MEASURED


def _fitting(rows: list[dict], key: str, budget_mib: float, keys: list[str]) -> _Fits | str:
    """The jobs that fit, or why none can."""
    ok = [r for r in rows if r["status"] == Status.OK]
    not_ok = status_counts([r for r in rows if r["status"] != Status.OK])
    not_ok_note = _left_out_note(rows, key, (Status.OK,))
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
    return _Fits(fits, len(measured), skipped + not_ok_note, key)


def _fastest(found: _Fits, key: str, budget_mib: float, keys: list[str]) -> tuple[dict | None, list, str]:
    """The fastest fitting job; among the equally fast (within TIE_REL) the smaller peak wins: more headroom
    for the same speed. Then the faster, then a stable configuration order."""
    fits, src, peak = found.rows, found.source, found.peak
    time_key = src.time_key
    timed = [r for r in fits if r[time_key] is not None]
    if not timed:
        return None, [], src.untimed.format(n=len(fits), budget=budget_mib)
    fastest = min(r[time_key] for r in timed)
    tied = sorted((r for r in timed if r[time_key] <= fastest * (1 + TIE_REL)),
                  key=lambda r: (r[peak], r[time_key], [sort_key(r["params"].get(k)) for k in keys]))
    best, ties = tied[0], tied[1:]
    reason = (f"Fastest that fits {budget_mib:.0f} MiB of {key}{src.by}: {describe(best, keys)} at "
              f"{best[time_key]:.3g} {src.time_words}, {src.peak_words} {best[peak]:.0f} MiB, "
              f"{budget_mib - best[peak]:.0f} MiB headroom. {len(fits)} of {found.measured} {src.jobs_words}")
    if ties:
        names = "; ".join(f"{describe(t, keys)} ({t[time_key]:.3g} s/step, {t[peak]:.0f} MiB)" for t in ties)
        reason += (f" Tied within {TIE_REL:.0%} on {src.time_name} with: {names}; picked the one with the lowest "
                   f"{src.peak_words} memory.")
    return best, ties, reason + _mixed_workload_note(fits, best)


def _from_predictions(rows: list[dict], key: str, budget_mib: float, keys: list[str], scope: str,
                      measured_reason: str) -> BudgetAnswer:
    """The answer from the planner's figures, for when the measured ones gave none (`measured_reason`)."""
    found = _predicted_fitting(rows, key, budget_mib, keys)
    if not isinstance(found, _Fits):  # None: nothing predicted either, the measured answer stands as it always did
        return BudgetAnswer(None, scope + measured_reason + ("" if found is None else " " + found), key, budget_mib)
    best, ties, reason = _fastest(found, key, budget_mib, keys)
    if best is None:
        return BudgetAnswer(None, scope + measured_reason + " " + reason, key, budget_mib)
    reason += _measured_context(rows, key, budget_mib) + found.notes
    return BudgetAnswer(best, scope + reason, key, budget_mib, ties, PREDICTED.name)


def _predicted_candidates(rows: list[dict], key: str) -> list[dict]:
    """ok and planned jobs with no measured figure for `key` but a predicted one."""
    predicted = PREDICTED_FOR.get(key)
    if predicted is None:
        return []
    return [r for r in rows if r["status"] in PREDICTED_STATUSES and r[key] is None and r[predicted] is not None]


def _predicted_fitting(rows: list[dict], key: str, budget_mib: float, keys: list[str]) -> _Fits | str | None:
    """Like `_fitting` on the planner's figures; None when no job has one to offer."""
    candidates = _predicted_candidates(rows, key)
    if not candidates:
        return None
    predicted = PREDICTED_FOR[key]
    fits = [r for r in candidates if r[predicted] <= budget_mib]
    if not fits:
        low = min(candidates, key=lambda r: r[predicted])
        return (f"By predicted figures nothing fits either: the smallest predicted peak is {low[predicted]:.0f} MiB "
                f"({describe(low, keys)}).")
    return _Fits(fits, len(candidates), _left_out_note(rows, key, PREDICTED_STATUSES), predicted, PREDICTED)


def _measured_context(rows: list[dict], key: str, budget_mib: float) -> str:
    """Why the measured figures gave no answer, after a predicted one."""
    ok = [r for r in rows if r["status"] == Status.OK]
    measured = [r[key] for r in ok if r[key] is not None]
    if not measured:
        why = " (no GPU present)" if ok and key.startswith("gpu_") else ""
        return f" No ok job has a measured {key}{why}, so this rests on predictions alone."
    if min(measured) > budget_mib:
        return f" No measured job fits: the smallest measured peak is {min(measured):.0f} MiB."
    return " The measured jobs that fit have no median step time."


def _predicted_not_compared(rows: list[dict], key: str, budget_mib: float, keys: list[str], best: dict) -> str:
    """After a measured answer: the jobs with only predicted figures, which it was not weighed against."""
    candidates = _predicted_candidates(rows, key)
    if not candidates:
        return ""
    predicted = PREDICTED_FOR[key]
    fits = [r for r in candidates if r[predicted] <= budget_mib]
    note = (f" {len(candidates)} job(s) have only predicted figures ({len(fits)} fit by prediction); measured "
            "figures come first, so they were not compared.")
    floor = [r for r in fits if r[PLAN_TIME_KEY] is not None and r[PLAN_TIME_KEY] < best[TIME_KEY]]
    if floor:
        quick = min(floor, key=lambda r: r[PLAN_TIME_KEY])
        note += (f" {describe(quick, keys)} has a predicted time floor of {quick[PLAN_TIME_KEY]:.3g} s/step, below "
                 "the chosen job's median: it may be faster; run it to know.")
    return note


def _left_out_note(rows: list[dict], key: str, accepted: tuple[str, ...]) -> str:
    """` Did not finish ok: 1 oom.`; planned jobs are named apart (they were not run), except those whose
    prediction the answer weighs or mentions already."""
    offered = {id(r) for r in _predicted_candidates(rows, key)}
    failed = [r for r in rows if r["status"] not in (*accepted, Status.PLANNED)]
    planned = [r for r in rows if r["status"] == Status.PLANNED and id(r) not in offered]
    note = f" Did not finish ok: {status_counts(failed)}." if failed else ""
    if planned:
        note += f" {len(planned)} planned job(s) (not run) have no predicted {key}."
    return note


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

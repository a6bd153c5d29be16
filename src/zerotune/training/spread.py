"""The spread of a rung's figure: how far a trial's samples/s over its timed steps could be from its run's own
rate, by the steps' jitter alone (training/rungs.py reports it; training/halving.py compares by it)."""

from __future__ import annotations

import math
import statistics

SPREAD_ATTR = "spread_at_{}"   # a trial's user attr: the relative half-width of its figure at that rung
CONFIDENCE = 0.9               # of the interval a rung's spread is the half-width of
ONE_STEP_SPREAD = 1.0          # a figure from one step has no spread to measure: taken as ±100%


def rate_spread(durations: list[float], samples: list[int]) -> float:
    """The relative half-width of the 90% confidence interval of the mean samples/s of these steps (Student's
    t over the per-step rates): how far a rung's figure could be from the run's own rate by step-to-step jitter
    alone. What moves a whole run (another process, a node's clock) it cannot see: min_spread floors it."""
    from scipy.stats import t as student_t

    rates = [n / d for n, d in zip(samples, durations, strict=True) if d > 0]
    if len(rates) < 2:
        return ONE_STEP_SPREAD
    mean = statistics.fmean(rates)
    half = float(student_t.ppf(0.5 + CONFIDENCE / 2, len(rates) - 1)) * statistics.stdev(rates) / math.sqrt(len(rates))
    return half / mean if mean > 0 else ONE_STEP_SPREAD

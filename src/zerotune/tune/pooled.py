"""The search's figures pooled with their neighbours': which trials become finalists.

The search runs each configuration once, and one run here varies by ±7-13%: on a workload where a dozen
configurations are one run in effect (2 processes at micro batch 16, any ZeRO stage), which of them a single
measurement puts near the best is chance, and so is the answer. Every trial also says something about its
knobs: stage 1 at 2 processes x micro batch 16 was measured alone, but stage 1 and "2 x 16" were measured in
many others. A knobs model (log samples/s = the sum of one effect per knob value, fit by least squares over
every trial with a figure, pruned ones at their last rung) predicts each configuration from all of them; a
trial's pooled figure is the geometric mean of its own figure and that prediction (the model counts as one
more measurement). Measured on the README's workload: the cheapest of the fast group was measured at 0.76-0.79
of the best in 3 of 6 searches, outside the spreads, and pooled at 0.87-0.94, inside them.
"""

from __future__ import annotations

import math

from zerotune.tune.study import Trial

# A ridge on the effects: the knobs' values are one-hot and collinear (each knob's values sum to the intercept),
# and a value seen in one trial alone would otherwise fit that trial exactly.
RIDGE = 0.5
# Fewer trials than this many per model term: the model would mostly echo its trials; the figures stand alone.
TRIALS_PER_TERM = 2
# Knobs whose effect depends on each other: one combined term (a rank's batch and how many ranks share a host).
JOINT = ("launch.num_processes", "train.batch_size")


def pooled_figures(trials: list[Trial]) -> dict[int, float]:
    """Trial number -> pooled samples/s, for every complete trial. The measured figures where the trials are too
    few for the model (TRIALS_PER_TERM per term)."""
    import numpy as np

    measured = [t for t in trials if t.samples_per_s and t.samples_per_s > 0]
    complete = {t.number: float(t.samples_per_s or 0.0) for t in trials if t.complete}
    terms = sorted({term for t in measured for term in _terms(t)})
    if len(measured) < TRIALS_PER_TERM * (len(terms) + 1):
        return complete
    column = {term: i + 1 for i, term in enumerate(terms)}
    design = np.zeros((len(measured), len(terms) + 1))
    design[:, 0] = 1.0
    for row, trial in enumerate(measured):
        for term in _terms(trial):
            design[row, column[term]] = 1.0
    logs = np.log([float(t.samples_per_s or 0.0) for t in measured])
    penalty = RIDGE * np.eye(len(terms) + 1)
    penalty[0, 0] = 0.0  # the intercept (the workload's own speed) is not shrunk
    effects = np.linalg.solve(design.T @ design + penalty, design.T @ logs)
    predicted = {t.number: float(np.exp(design[row] @ effects)) for row, t in enumerate(measured)}
    return {number: math.sqrt(figure * predicted[number]) for number, figure in complete.items()}


def shape(trial: Trial) -> tuple[str, ...]:
    """What a trial computes per step, apart from how ZeRO holds the model: its JOINT knobs' values (its
    processes x micro batch). Trials of one shape differ in memory (stage, offload, overlap) far more than in
    speed."""
    knobs = trial.screened.candidate.knobs
    return tuple(str(knobs.get(k, "")) for k in JOINT)


def _terms(trial: Trial) -> list[str]:
    knobs = trial.screened.candidate.knobs
    joint = " ".join(f"{k}={knobs[k]}" for k in JOINT if k in knobs)
    return [*(f"{k}={v}" for k, v in knobs.items() if k not in JOINT), *([joint] if joint else [])]

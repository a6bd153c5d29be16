"""Successive halving's rungs, shared by the sweeper (which creates the study) and each trial's job (which reports
samples/s over its timed steps at each rung, with that figure's spread), and the pruner of
`hydra.sweeper.pruner=successive_halving`, which stops a trial only when it is behind by more than both spreads."""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Protocol

import optuna

from zerotune.config.schema import Trial
from zerotune.rundir.summary import Status

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


log = logging.getLogger(__name__)

PRUNERS = ("successive_halving", "hyperband", "none")  # none: every trial runs max_steps (a grid)
PRUNED = Status.PRUNED  # Trainer.stopped_by, and the job's status, when the study stopped it at a rung


def rung_steps(min_steps: int, reduction_factor: int, max_steps: int) -> list[int]:
    """Timed steps at which a trial reports: min_steps x reduction_factor^k up to max_steps, and max_steps."""
    steps, rung = [], min_steps
    while rung < max_steps:
        steps.append(rung)
        rung *= reduction_factor
    return [*steps, max_steps]


class PrunerSettings(Protocol):
    """What a pruner is built from: a job's `trial` block, or the sweeper's TuneSettings (the same names)."""

    @property
    def pruner(self) -> str: ...
    @property
    def min_steps(self) -> int: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def reduction_factor(self) -> int: ...
    @property
    def min_spread(self) -> float: ...


def make_pruner(trial: PrunerSettings):
    """The pruner for these settings (the job rebuilds the sweeper's: a pruner is not stored in a study)."""
    import optuna

    if trial.pruner == "none":
        return optuna.pruners.NopPruner()
    if trial.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=trial.min_steps, max_resource=trial.max_steps,
                                              reduction_factor=trial.reduction_factor)


    return SpreadHalvingPruner(int(trial.reduction_factor), float(trial.min_spread))




def journal(path: str):
    """The study's storage: an append-only journal file that the sweeper and its jobs (other processes, other
    nodes over a shared file system) write with a lock."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(path))


class TrialRungs:
    """A trial's job, at each rung: report samples/s, and ask whether to stop (rank 0 asks; every rank is told)."""

    def __init__(self, trial: Trial, is_main: bool) -> None:
        self.warmup = int(trial.warmup_steps)
        self.rungs = set(rung_steps(trial.min_steps, trial.reduction_factor, trial.max_steps))
        self.last = int(trial.max_steps)
        self._trial = _open_trial(trial) if is_main else None

    def stop_here(self, step: int, timer: Any) -> bool:
        timed = step - self.warmup
        if timed not in self.rungs:
            return False
        stop = False
        if self._trial is not None:
            durations, samples = timer.durations[self.warmup:], timer.samples[self.warmup:]
            value = sum(samples) / sum(durations)
            self._trial.set_user_attr(SPREAD_ATTR.format(timed), rate_spread(durations, samples))
            self._trial.report(value, timed)
            # The last rung is the trial's whole measurement: it completes, whatever the pruner would say.
            stop = timed < self.last and self._trial.should_prune()
            if stop:
                log.info("tune: stopped at rung %d timed steps (%.3g samples/s)", timed, value)
        from zerotune.train import distributed

        return bool(distributed.broadcast_object(stop))  # ranks stop after the same step


def _open_trial(trial: Trial):
    import optuna

    # Set together by the tune sweeper on each of its jobs (hydra_plugins/zerotune_tune).
    assert trial.storage is not None and trial.study is not None and trial.number is not None
    storage = journal(trial.storage)
    study = optuna.load_study(study_name=trial.study, storage=storage, pruner=make_pruner(trial))
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(trial.study),
                                                                int(trial.number))
    return optuna.trial.Trial(study, trial_id)


class SpreadHalvingPruner(optuna.pruners.BasePruner):
    """Asynchronous successive halving whose cut respects each figure's spread: beyond Optuna's best
    1/reduction_factor at a rung, a trial is kept while figure x (1 + its spread) is not below cut x (1 - the cut's
    spread). Spreads are rate_spread's, floored by min_spread. A failed trial counts 0 at every rung."""

    def __init__(self, reduction_factor: int, min_spread: float) -> None:
        self.reduction_factor, self.min_spread = reduction_factor, min_spread

    def prune(self, study, trial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        at_rung = [figure for figure in (self._figure(t, step) for t in study.get_trials(deepcopy=False))
                   if figure is not None]
        value, spread = self._figure(trial, step) or (0.0, self.min_spread)
        at_rung.sort(key=lambda figure: -figure[0])
        cut_value, cut_spread = at_rung[min(max(len(at_rung) // self.reduction_factor, 1), len(at_rung)) - 1]
        return value * (1 + spread) < cut_value * (1 - cut_spread)

    def _figure(self, trial, step: int) -> tuple[float, float] | None:
        """(samples/s, spread) a trial reported at `step`; None if it did not get there."""
        if step not in trial.intermediate_values:
            return None
        if trial.state == optuna.trial.TrialState.COMPLETE and trial.value == 0.0:
            return 0.0, 0.0  # failed: the worst score at every rung
        measured = trial.user_attrs.get(SPREAD_ATTR.format(step), ONE_STEP_SPREAD)
        return float(trial.intermediate_values[step]), max(float(measured), self.min_spread)

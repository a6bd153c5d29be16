"""Successive halving's rungs, shared by the sweeper (which creates the study) and each trial's job (which
reports to it). A trial's job reports samples/s over its timed steps (after `warmup_steps`) at each rung, with
that figure's spread; the pruner, reading every trial's figure and spread at that rung from the study's
journal, stops it there only when it is behind by more than both spreads (SpreadHalvingPruner)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from zerotune.rundir.status import Status
from zerotune.schema import Trial
from zerotune.training.spread import SPREAD_ATTR, rate_spread

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
    from zerotune.training.halving import SpreadHalvingPruner  # imports optuna: only where a study is used

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
        from zerotune.training import distributed

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

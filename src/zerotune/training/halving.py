"""The pruner of `hydra.sweeper.pruner=successive_halving`: successive halving that stops a trial only when it
is behind by more than the spread of the figures compared (training/spread.py measures them)."""

from __future__ import annotations

import optuna

from zerotune.training.spread import ONE_STEP_SPREAD, SPREAD_ATTR


class SpreadHalvingPruner(optuna.pruners.BasePruner):
    """Asynchronous successive halving whose cut respects each figure's spread.

    At a rung, Optuna's SuccessiveHalvingPruner keeps a trial whose figure is among the best 1/reduction_factor
    of the figures reported there. Here the trial is kept also when its figure could reach that cut: its
    optimistic bound, figure x (1 + its spread), is not below the cut's pessimistic one, cut x (1 - the cut's
    spread). Each spread is the rung's measured one (rate_spread), floored by min_spread. A trial that failed
    counts 0 at every rung (the sweeper scores it so)."""

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

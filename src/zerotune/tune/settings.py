"""The sweeper's settings (conf/hydra/sweeper/tune.yaml, `hydra.sweeper.<key>=...`), checked before any trial:
a bad value is a config error naming its key, with a value that works."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerotune.errors import ConfigError
from zerotune.training.rungs import PRUNERS


@dataclass(frozen=True)
class TuneSettings:
    name: str | None = None              # the winner's file: experiment/tuned_<name>.yaml
    global_batch: int | None = None      # samples per optimizer step; None: as the command line composes
    gpu: str | None = None               # a card not present: rank by the planner, run nothing
    n_trials: int | None = None          # None: every candidate the planner keeps
    seed: int = 0
    warmup_steps: int = 3
    min_steps: int = 4
    reduction_factor: int = 3
    max_steps: int = 12                  # the search only finds the finalists: their rounds are the measurement
    pruner: str = "successive_halving"
    min_spread: float = 0.10             # the least relative spread of a figure (rungs, finalists' rounds)
    finalists: int = 4                   # at most this many, within the spread of the best, are re-measured
    pair_rounds: int = 3                 # rounds of the finalists' re-measurement (0: none)
    pair_steps: int = 12                 # timed steps of each of those runs
    extra_rounds: int = 2                # more rounds for a close call (finalists.Comparison.close): 0 for none
    drop_by_plan: bool = True            # false: what the planner predicts won't fit (or needlessly checkpoints) runs too
    warm_workers: bool = True            # trials' workers forked from one process that imported once (launch/warm.py)
    space: dict[str, Any] = field(default_factory=dict)

    def trial_overrides(self) -> list[str]:
        """What every trial's job is told of the rungs (schema `trial`)."""
        return [f"trial.warmup_steps={self.warmup_steps}", f"trial.min_steps={self.min_steps}",
                f"trial.reduction_factor={self.reduction_factor}", f"trial.max_steps={self.max_steps}",
                f"trial.pruner={self.pruner}", f"trial.min_spread={self.min_spread}"]

    def round_overrides(self) -> list[str]:
        """What a finalist's re-measurement job is told: one rung of pair_steps, never stopped."""
        return [f"trial.warmup_steps={self.warmup_steps}", f"trial.min_steps={self.pair_steps}",
                f"trial.max_steps={self.pair_steps}", "trial.pruner=none", f"trial.min_spread={self.min_spread}"]


def read_settings(params: dict[str, Any]) -> TuneSettings:
    """TuneSettings from the sweeper's config node, every value checked."""
    known = TuneSettings.__dataclass_fields__
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(f"hydra.sweeper.{unknown[0]}", "not a setting of hydra/sweeper=tune",
                          f"one of: {', '.join(known)}")
    settings = TuneSettings(**{k: v for k, v in params.items() if k in known})
    _check_positive(settings, ("warmup_steps", "pair_rounds", "extra_rounds"), minimum=0)
    _check_positive(settings, ("min_steps", "max_steps", "global_batch", "n_trials", "finalists", "pair_steps"),
                    minimum=1)
    if isinstance(settings.min_spread, bool) or not isinstance(settings.min_spread, int | float) \
            or not 0 <= settings.min_spread < 1:
        raise ConfigError("hydra.sweeper.min_spread", f"must be a fraction in [0, 1), got {settings.min_spread!r}",
                          "hydra.sweeper.min_spread=0.1")
    _check_positive(settings, ("reduction_factor",), minimum=2)
    for key in ("drop_by_plan", "warm_workers"):
        if not isinstance(getattr(settings, key), bool):
            raise ConfigError(f"hydra.sweeper.{key}", f"must be true or false, got {getattr(settings, key)!r}",
                              f"hydra.sweeper.{key}=true")
    if settings.pruner not in PRUNERS:
        raise ConfigError("hydra.sweeper.pruner", f"unknown {settings.pruner!r}",
                          f"hydra.sweeper.pruner={' | '.join(PRUNERS)}")
    if settings.max_steps < settings.min_steps:
        raise ConfigError("hydra.sweeper.max_steps", f"{settings.max_steps} is below min_steps {settings.min_steps}",
                          f"hydra.sweeper.max_steps={settings.min_steps * settings.reduction_factor}")
    return settings


def _check_positive(settings: TuneSettings, keys: tuple[str, ...], minimum: int) -> None:
    for key in keys:
        value = getattr(settings, key)
        if value is None and key in ("global_batch", "n_trials"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"hydra.sweeper.{key}", f"must be a whole number >= {minimum}, got {value!r}",
                              f"hydra.sweeper.{key}={max(minimum, _suggested(key))}")


def _suggested(key: str) -> int:
    """A field's default, as the value a refusal suggests: 1 where the default is None or 0."""
    default = TuneSettings.__dataclass_fields__[key].default
    return default if isinstance(default, int) and default else 1

"""The fastest configuration, saved as an experiment file (`tuned_<name>.yaml` in the user's experiment folder,
./zerotune/experiment/ unless --config-dir names another): `zerotune train experiment=tuned_<name>` trains it."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from zerotune.compose.experiment_file import experiment_path, experiment_yaml, write_experiment
from zerotune.tune.report import Outcome, certainty
from zerotune.tune.study import without_trial_settings

NAME_KEY = "hydra.sweeper.name"


def default_name(model: str, resolution: int, global_batch: int, device: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{model}_{resolution}_gb{global_batch}_{device}")


def save_winner(outcome: Outcome, workload: list[str], name: str, sweep_dir: Path) -> Path | None:
    """Write the winner's experiment file; None when no candidate won."""
    best = outcome.winner()
    if best is None:
        return None
    path = experiment_path(f"tuned_{name}", key=NAME_KEY)
    chosen = next(s for s in outcome.screened if s.number == best["candidate"])
    kept = without_trial_settings(workload)
    verdict = outcome.verdict
    if verdict is not None:
        figure = verdict.chosen.median
        how = f"the median of {len(verdict.chosen.rounds)} rounds re-measuring the finalists"
        sure = certainty(verdict)
    else:
        figure = best["samples_per_s"]
        how = ("predicted by the planner's time floor, not measured" if outcome.predicted else
               f"measured over {best['timed_steps']} timed steps after the warm-up")
        sure = ("unmeasured: the planner's ranking" if outcome.predicted else
                f"not re-measured against another ({outcome.why_no_rounds})")
    comments = [f"Found by `zerotune tune` on {outcome.machine}, {datetime.now():%Y-%m-%d %H:%M}: "
                f"{figure:.4g} samples/s at a global batch of {outcome.global_batch} ({how}).",
                f"How sure: {sure}.",
                f"Every candidate, with its rungs and why others lost: {sweep_dir / 'tune.md'}"]
    reference = [f"reference.name=tuned_{name}", f"reference.samples_per_s={figure:.6g}"]
    write_experiment(path, experiment_yaml([*kept, *chosen.candidate.overrides(), *reference], comments))
    return path

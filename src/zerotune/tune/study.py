"""The measured search: the kept candidates as Optuna trials, one job each, stopped by the study's pruner where they
fall behind (a failed or OOM job scores 0 samples/s, and the search goes on); and the pooled figures that pick the
finalists."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zerotune.rundir.summary import Status
from zerotune.train.rungs import ONE_STEP_SPREAD, PRUNED, SPREAD_ATTR, journal, make_pruner
from zerotune.tune.space import KEPT, NO_FIT, SLOWER, Screened, TuneSettings

log = logging.getLogger("zerotune")

STUDY = "tune"
ROUNDS = "rounds"    # the finalists' re-measurement: its own study in the same journal, never pruned
JOURNAL = "tune.journal"
# Trials are measurements: no checkpoint, no sampling, no logger; what the command line set for these is replaced.
TRIAL_SETTINGS = ("checkpoint.final=false", "checkpoint.every_n_steps=0", "evaluate.enabled=false",
                  "validation.prompts=[]", "validation.prompt_file=null")


@dataclass
class Trial:
    screened: Screened
    number: int                      # Optuna's trial number
    status: str                      # the report row's: a Status word, or missing | running
    samples_per_s: float | None      # over every timed step it ran (after the sweeper's warm-up)
    timed_steps: int
    rungs: dict[int, float]          # timed steps -> samples/s reported there
    row: dict                        # the job's report row (report/collect.py)
    wall_s: float
    spread: float = ONE_STEP_SPREAD  # the relative spread of its figure at its last rung (train/rungs.py)

    @property
    def complete(self) -> bool:
        """It ran every rung and measured samples/s."""
        return self.status == Status.OK and bool(self.samples_per_s)

    @property
    def score(self) -> float:
        """What the study was told: samples/s, or 0 for a job that failed."""
        return self.samples_per_s if self.status in (Status.OK, PRUNED) and self.samples_per_s else 0.0


def run_trials(settings: TuneSettings, screened: list[Screened], workload: list[str], sweep_dir: Path,
               launch: Callable[[list[str], int], Path]) -> list[Trial]:
    """Every kept candidate (or hydra.sweeper.n_trials of them) as a trial. `launch(overrides, job_number)`
    runs one job and returns its run folder."""
    import optuna

    kept = [s for s in screened if s.verdict == KEPT or (not settings.drop_by_plan and s.verdict in (NO_FIT, SLOWER))]
    if not kept:
        return []
    storage = journal(str(sweep_dir / JOURNAL))
    study = optuna.create_study(
        storage=storage, study_name=STUDY, direction="maximize", load_if_exists=False,
        sampler=optuna.samplers.GridSampler({"candidate": [s.number for s in kept]}, seed=settings.seed),
        pruner=make_pruner(settings))
    by_number = {s.number: s for s in kept}
    trials: list[Trial] = []

    def objective(optuna_trial) -> float:
        chosen = by_number[optuna_trial.suggest_categorical("candidate", list(by_number))]
        started = time.perf_counter()
        overrides = _trial_overrides(settings, chosen, workload, sweep_dir, STUDY, optuna_trial.number,
                                     settings.trial_overrides(), settings.max_steps)
        run_dir = launch(overrides, len(trials))
        trial = _outcome(chosen, optuna_trial, sweep_dir, run_dir, time.perf_counter() - started)
        trials.append(trial)
        log.info(progress_line(trial, len(trials), len(kept), trials))
        optuna_trial.set_user_attr("status", trial.status)
        if trial.status == PRUNED:
            raise optuna.TrialPruned()
        if trial.score == 0.0:
            _worst_at_every_rung(storage, optuna_trial.number)
        return trial.score  # a failed or out-of-memory job: the worst score, and the search goes on

    # optimize(), not ask/tell: the grid sampler ends the study from inside it once every candidate has run.
    study.optimize(objective, n_trials=min(settings.n_trials or len(kept), len(kept)))
    return trials


def run_rounds(settings: TuneSettings, finalists: list[Trial], rounds: range, workload: list[str],
               sweep_dir: Path, launch: Callable[[list[str], int], Path], first_job: int) -> list[list[float | None]]:
    """Each finalist re-measured once per round, for the round numbers given (the first settings.pair_rounds,
    or a close call's more), in the order round_order gives: samples/s of each run (None where it failed), by
    finalist, by round."""
    import optuna

    storage = journal(str(sweep_dir / JOURNAL))
    study = optuna.create_study(storage=storage, study_name=ROUNDS, direction="maximize", load_if_exists=True,
                                pruner=optuna.pruners.NopPruner())
    figures: list[list[float | None]] = [[None] * len(rounds) for _ in finalists]
    job = first_job
    for slot, round_number in enumerate(rounds):
        for index in round_order(len(finalists), round_number):
            chosen = finalists[index].screened
            asked = study.ask()
            overrides = _trial_overrides(settings, chosen, workload, sweep_dir, ROUNDS, asked.number,
                                         settings.round_overrides(), settings.pair_steps)
            started = time.perf_counter()
            run_dir = launch(overrides, job)
            job += 1
            trial = _outcome(chosen, asked, sweep_dir, run_dir, time.perf_counter() - started)
            figures[index][slot] = trial.samples_per_s if trial.status == Status.OK else None
            study.tell(asked, figures[index][slot] or 0.0)
            log.info("tune: round %d/%d, candidate %d %s: %s samples/s", round_number + 1, rounds.stop,
                     chosen.number, chosen.candidate.label(),
                     f"{trial.samples_per_s:.4g}" if trial.samples_per_s else f"none ({trial.status})")
    return figures


def round_order(count: int, round_number: int) -> list[int]:
    """Finalists' indexes in a round's running order: forward, then backward (A B C, C B A, ...), so that a
    drift over the rounds favours none."""
    order = list(range(count))
    return order if round_number % 2 == 0 else order[::-1]


def _worst_at_every_rung(storage, number: int) -> None:
    """A job that failed after a rung (an OOM at a later step) must not stop others with what it reported there:
    its rungs take its score too, 0 (the pruner compares the rungs' values, kept as the trial's system attrs)."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(STUDY), number)
    for key in storage.get_trial(trial_id).system_attrs:
        if key.startswith("completed_rung_"):
            storage.set_trial_system_attr(trial_id, key, 0.0)


def without_trial_settings(workload: list[str]) -> list[str]:
    """The workload less what every trial sets itself (TRIAL_SETTINGS and train.max_steps)."""
    replaced = {line.split("=", 1)[0] for line in TRIAL_SETTINGS} | {"train.max_steps"}
    return [line for line in workload if line.split("=", 1)[0].lstrip("+~") not in replaced]


def _trial_overrides(settings: TuneSettings, chosen: Screened, workload: list[str], sweep_dir: Path, study: str,
                     number: int, rungs: list[str], timed_steps: int) -> list[str]:
    """A job of `study` (the search's trials, or the finalists' rounds): the workload, the candidate, what every
    trial sets, its rungs, and warmup_steps + `timed_steps` steps."""
    kept = without_trial_settings(workload)
    # drop_by_plan=false runs what the planner predicts won't fit: its job's guard must let it try.
    guard = [] if settings.drop_by_plan else ["plan.guard=warn"]
    return [*kept, *chosen.candidate.overrides(), *TRIAL_SETTINGS, *guard, *rungs,
            f"train.max_steps={settings.warmup_steps + timed_steps}",
            f"trial.storage={sweep_dir.resolve() / JOURNAL}", f"trial.study={study}", f"trial.number={number}"]


def _outcome(chosen: Screened, optuna_trial, sweep_dir: Path, run_dir: Path, wall_s: float) -> Trial:
    from zerotune.report.collect import read_job

    row = read_job(sweep_dir, run_dir)
    # The study's own record of the rungs: what the job reported, whatever became of its summary.
    frozen = next(t for t in optuna_trial.study.get_trials(deepcopy=False) if t.number == optuna_trial.number)
    rungs = {int(step): float(value) for step, value in sorted(frozen.intermediate_values.items())}
    timed = max(rungs) if rungs else 0
    # Every trial's figure over the same warm-up (the sweeper's): the value its job reported at its last rung.
    value = rungs[timed] if rungs and row["status"] in (Status.OK, PRUNED) else None
    spread = float(frozen.user_attrs.get(SPREAD_ATTR.format(timed), ONE_STEP_SPREAD))
    return Trial(chosen, optuna_trial.number, row["status"], value, timed, rungs, row, wall_s, spread)


def progress_line(trial: Trial, done: int, total: int, trials: list[Trial]) -> str:
    best = max((t for t in trials if t.complete), key=lambda t: t.samples_per_s or 0.0,
               default=None)
    if trial.complete:
        what = f"{trial.samples_per_s:.4g} samples/s over {trial.timed_steps} timed steps"
    elif trial.status == PRUNED and trial.rungs:
        what = f"stopped at rung {trial.timed_steps} steps, {trial.rungs[trial.timed_steps]:.4g} samples/s"
    else:
        what = f"{trial.status}: {trial.row.get('error') or 'no samples/s'} (scored 0)"
    lead = f"best {best.samples_per_s:.4g} (candidate {best.screened.number})" if best else "no complete trial yet"
    return (f"tune [{done}/{total}] candidate {trial.screened.number} {trial.screened.candidate.label()}: {what}; "
            f"{lead}; {trial.wall_s:.1f} s")


# A ridge on the effects: the knobs' values are one-hot and collinear (each knob's values sum to the intercept),
# and a value seen in one trial alone would otherwise fit that trial exactly.
RIDGE = 0.5
# Fewer trials than this many per model term: the model would mostly echo its trials; the figures stand alone.
TRIALS_PER_TERM = 2
# Knobs whose effect depends on each other: one combined term (a rank's batch and how many ranks share a host).
JOINT = ("launch.num_processes", "train.batch_size")


def pooled_figures(trials: list[Trial]) -> dict[int, float]:
    """Trial number -> pooled samples/s, for every complete trial: the geometric mean of its figure and a knobs
    model's prediction (log samples/s = a sum of one effect per knob value, by least squares over every trial with
    a figure, pruned ones at their last rung). One run varies by ±7-13%, so which of a dozen near-equal
    configurations one measurement puts near the best is chance; on the README's workload the cheapest of the fast
    group was measured at 0.76-0.79 of the best in 3 of 6 searches, outside the spreads, and pooled at 0.87-0.94,
    inside them. The measured figures where the trials are too few for the model (TRIALS_PER_TERM per term)."""
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

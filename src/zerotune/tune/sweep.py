"""One tune sweep, start to end: the workload's global batch, the candidates, the screen, then the trials (or,
for a card not present, the planner's ranking), the report and the winner's file."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from zerotune.config.compose.overrides import as_typed
from zerotune.config.compose.settle import Settled
from zerotune.config.schema import launch_world_size
from zerotune.job import warm
from zerotune.tune import finalists
from zerotune.tune import outcome as report
from zerotune.tune.finalists import Finalist, Verdict
from zerotune.tune.outcome import Outcome, default_name, save_winner
from zerotune.tune.space import (
    INVALID,
    KEPT,
    Candidate,
    Screened,
    TuneSettings,
    candidates,
    knob_values,
    read_command_line,
    screen,
)
from zerotune.tune.study import Trial, run_rounds, run_trials

log = logging.getLogger("zerotune")
WARM_WAIT_S = 60.0  # the template's imports: about 7 s on 2 busy cores


def tune_sweep(settings: TuneSettings, arguments: list[str], settle: Callable[[list[str]], Settled],
               launch: Callable[[list[str], int], Path], sweep_dir: Path) -> Outcome:
    started = time.perf_counter()
    # The workers' template imports while the candidates are screened (job/warm.py); on a card too, where
    # its imports leave CUDA's driver alone. None for a card not present: no trial runs.
    warm_log = sweep_dir / "warm_template.log"
    with warm.template(warm_log, enabled=settings.warm_workers and not settings.gpu) as template:
        return _tune(settings, arguments, settle, launch, sweep_dir, started, template)


def _tune(settings: TuneSettings, arguments: list[str], settle: Callable[[list[str]], Settled],
          launch: Callable[[list[str], int], Path], sweep_dir: Path, started: float,
          template: warm.Template) -> Outcome:
    line = read_command_line(arguments)
    fixed = [f"{k}={line.values[k][0]}" for k in sorted(line.fixed)]
    base = settle([*line.workload, *line.accumulation, *fixed]).config
    global_batch = settings.global_batch or (base.train.batch_size * base.train.grad_accum *
                                             launch_world_size(base.launch))
    gpus = _gpu_count()
    values = knob_values(line, settings.space, 1 if settings.gpu else gpus)  # a named card: one process on it
    found, dropped = candidates(values, global_batch, base.launch.nnodes, settings.space.get("train.batch_size"))
    screened = screen(found, line.workload, settle, settings.gpu)
    screened += [Screened(len(found) + i, Candidate({"config": label}, 0), INVALID, why)
                 for i, (label, why) in enumerate(dropped)]
    kept = sum(s.verdict == KEPT for s in screened)
    log.info("tune: %d candidates, %d kept for trials, %d dropped before any trial (%.1f s): see tune.md",
             len(screened), kept, len(screened) - kept, time.perf_counter() - started)
    device = settings.gpu or (_gpu_name() if gpus else "cpu")
    outcome = Outcome(workload=" ".join(as_typed(line.workload)) or "the default job", global_batch=global_batch,
                      machine=_machine(settings.gpu, gpus), screened=screened, predicted=bool(settings.gpu))
    if not settings.gpu:
        template.wait_ready(WARM_WAIT_S)  # every trial's start the same: forked, none paying the imports
        outcome.trials = run_trials(settings, screened, line.workload, sweep_dir, launch)
        outcome.verdict = remeasure(settings, outcome.trials, line.workload, sweep_dir, launch)
        outcome.why_no_rounds = _why_no_rounds(settings, outcome)
    outcome.wall_s = time.perf_counter() - started
    name = settings.name or default_name(base.model.name, base.resolution.size, global_batch, device)
    outcome.winner_file = save_winner(outcome, line.workload, name, sweep_dir)
    written = report.write(outcome, sweep_dir)
    log.info("tune: %s\n  every candidate: %s", report.answer(outcome), written)
    return outcome


def remeasure(settings: TuneSettings, trials: list[Trial], workload: list[str], sweep_dir: Path,
              launch: Callable[[list[str], int], Path]) -> Verdict | None:
    """The finalists' rounds and the verdict; None where fewer than two finalists, or no rounds, leave nothing
    to compare (the search's best stands). Close calls (Comparison.close) cheaper than the fastest get
    settings.extra_rounds more rounds, the fastest and those only, and the verdict is taken again over every
    round."""
    chosen = finalists.pick(trials, settings.min_spread, settings.finalists)
    if len(chosen) < 2 or settings.pair_rounds == 0:
        return None
    log.info("tune: %d finalists (the best, the runner-up, those near the best, and the cheapest variant of each's "
             "processes x micro batch: finalists.pick), re-measured in %d rounds of %d timed steps", len(chosen),
             settings.pair_rounds, settings.pair_steps)
    first = range(settings.pair_rounds)
    figures = run_rounds(settings, chosen, first, workload, sweep_dir, launch, first_job=len(trials))
    verdict = finalists.decide([Finalist(t, f) for t, f in zip(chosen, figures, strict=True)], settings.min_spread)
    close = verdict.deciding_close_calls() if verdict is not None else []
    if verdict is not None and close and settings.extra_rounds:
        again = [verdict.finalists[0], *(c.other for c in close)]
        log.info("tune: %d close call(s): %d more rounds of the fastest (%s) and %s", len(close),
                 settings.extra_rounds, again[0].screened.candidate.label(),
                 ", ".join(f.screened.candidate.label() for f in again[1:]))
        more = run_rounds(settings, [f.trial for f in again], range(first.stop, first.stop + settings.extra_rounds),
                          workload, sweep_dir, launch, first_job=len(trials) + len(chosen) * len(first))
        for finalist, extra in zip(again, more, strict=True):
            finalist.rounds += extra
        verdict = finalists.decide(verdict.finalists, settings.min_spread)
    if verdict is None:
        return None
    return replace(verdict, within_noise=finalists.within_noise(trials, settings.min_spread),
                   resampled=finalists.resampled_choices(verdict))


def _why_no_rounds(settings: TuneSettings, outcome: Outcome) -> str:
    if outcome.verdict is not None:
        return ""
    if settings.pair_rounds == 0 or settings.finalists < 2:
        return "hydra.sweeper.pair_rounds=0 or finalists=1"
    complete = sum(1 for t in outcome.trials if t.complete)
    return "no other trial completed" if complete < 2 else "the finalists' rounds failed"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0).replace(" ", "_").lower()


def _machine(named_gpu: str | None, gpus: int) -> str:
    if named_gpu:
        return f"{named_gpu} (not present: the planner's prediction)"
    where = f"{gpus} x {_gpu_name()}" if gpus else f"CPU only, {len(os.sched_getaffinity(0))} cores"
    return f"{socket.gethostname()}, {where}"

"""What a tune sweep leaves in its folder: tune.md (the answer, the finalists' rounds, a row per candidate), tune.csv,
and the winner as experiment/tuned_<name>.yaml in the user's folder: `zerotune train experiment=tuned_<name>`."""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from zerotune.config.compose import experiment_path, experiment_yaml, write_experiment
from zerotune.rundir.summary import Status
from zerotune.tune.finalists import RESAMPLES, Verdict
from zerotune.tune.space import KEPT, SLOWER, Screened, planned_peak_mib
from zerotune.tune.study import Trial, pooled_figures, without_trial_settings

# A candidate ranked by its predicted time floor, run or not: a row of the tune report, not a run's status.
PREDICTED = "predicted"


@dataclass
class Outcome:
    workload: str
    global_batch: int
    machine: str
    screened: list[Screened]
    trials: list[Trial] = field(default_factory=list)
    predicted: bool = False          # ranked by the planner's time floor: no trial ran
    wall_s: float = 0.0
    winner_file: Path | None = None
    verdict: Verdict | None = None   # the finalists' rounds; None: no two finalists (the search's best stands)
    why_no_rounds: str = "no other trial completed"

    def winner(self) -> dict | None:
        """The row of what is written: the verdict's choice, else the search's best."""
        rows = self.rows()
        if self.verdict is not None:
            return next(r for r in rows if r["candidate"] == self.verdict.chosen.screened.number)
        return rows[0] if rows and rows[0]["samples_per_s"] and rows[0]["status"] in (Status.OK, PREDICTED) else None

    def rows(self) -> list[dict]:
        """Every candidate, best first: complete trials by samples/s, then stopped ones, failed ones, dropped."""
        ran = {t.screened.number: t for t in self.trials}
        pooled = pooled_figures(self.trials)
        rows = [_row(s, ran.get(s.number), self.global_batch, self.predicted, pooled) for s in self.screened]
        return sorted(rows, key=_rank_key)


def _row(s: Screened, trial: Trial | None, global_batch: int, predicted: bool, pooled: dict[int, float]) -> dict:
    row = {"candidate": s.number, "config": s.candidate.label(), "grad_accum": s.candidate.grad_accum,
           "status": s.verdict, "timed_steps": None, "samples_per_s": None, "pooled_samples_per_s": None,
           "rungs": "", "reason": s.reason,
           "gpu_peak_process_mib": None, "host_peak_rss_mib": None, "run_dir": None,
           "plan_peak_mib": planned_peak_mib(s.plan),
           "plan_time_floor_s": s.plan.get("time_floor_s"), "plan_bound": s.plan.get("bound")}
    if predicted and s.verdict == KEPT:
        # A floor without its compute term would rank an offloaded run (whose optimizer term is known) above
        # one whose compute is unknown: such a candidate has no prediction.
        floor = s.plan.get("time_floor_s") if "compute" in s.plan.get("terms", {}) else None
        row.update(status=PREDICTED, samples_per_s=global_batch / floor if floor else None,
                   reason=_binding(s.plan) if floor else "no time floor: unknown " +
                   ", ".join(s.plan.get("terms_unknown") or ["terms"]))
    elif trial is not None:
        row.update(status=trial.status, timed_steps=trial.timed_steps, samples_per_s=trial.samples_per_s,
                   pooled_samples_per_s=pooled.get(trial.number),
                   rungs=" ".join(f"{k}:{v:.4g}" for k, v in trial.rungs.items()),
                   reason="" if trial.status in (Status.OK, Status.PRUNED) else (trial.row.get("error") or trial.status),
                   gpu_peak_process_mib=trial.row.get("gpu_peak_process_mib"),
                   host_peak_rss_mib=trial.row.get("host_peak_rss_mib"), run_dir=trial.row.get("run_dir"))
    elif s.verdict == KEPT:
        row.update(status="not_run", reason="beyond hydra.sweeper.n_trials")
    return row


def _binding(plan: dict) -> str:
    terms = sorted((plan.get("terms") or {}).items(), key=lambda kv: -kv[1])[:3]
    return "bound by " + ", ".join(f"{name} {seconds:.3g} s" for name, seconds in terms) if terms else ""


def _rank_key(row: dict) -> tuple:
    """Fastest first; among equals, the one the planner gives the most room (a floor is often shared)."""
    order = {Status.OK: 0, PREDICTED: 0, Status.PRUNED: 1}.get(row["status"], 2 if row["run_dir"] else 3)
    return order, -(row["samples_per_s"] or 0.0), row["plan_peak_mib"] or 0.0, row["candidate"]


def write(outcome: Outcome, folder: Path) -> Path:
    rows = outcome.rows()
    with open(folder / "tune.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["candidate"])
        writer.writeheader()
        writer.writerows(rows)
    (folder / "tune.md").write_text(markdown(outcome, rows))
    return folder / "tune.md"


def markdown(outcome: Outcome, rows: list[dict]) -> str:
    counts = Counter(row["status"] for row in rows)
    lines = [f"# tune: {outcome.workload}, global batch {outcome.global_batch}", "",
             f"- machine: {outcome.machine}",
             f"- candidates: {len(rows)} ({', '.join(f'{n} {s}' for s, n in counts.items())})",
             f"- wall time: {outcome.wall_s:.1f} s", "", answer(outcome), "", smallest_peak(rows), "",
             *paired_table(outcome.verdict),
             "Pooled: a complete trial's samples/s with its neighbours' (tune/study.py), which picks the finalists.",
             "", "| # | config | accum | status | timed steps | samples/s | pooled | rungs (steps:samples/s) | "
             "GPU peak MiB | host peak MiB | planned peak MiB | why |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['candidate']} | {r['config']} | {r['grad_accum']} | {r['status']} | "
                     f"{_cell(r['timed_steps'])} | {_cell(r['samples_per_s'], '{:.4g}')} | "
                     f"{_cell(r['pooled_samples_per_s'], '{:.4g}')} | {r['rungs']} | "
                     f"{_cell(r['gpu_peak_process_mib'], '{:,.0f}', 'unmeasured' if r['run_dir'] else '-')} | "
                     f"{_cell(r['host_peak_rss_mib'], '{:,.0f}')} | {_cell(r['plan_peak_mib'], '{:,.0f}')} | "
                     f"{r['reason']} |")
    return "\n".join(lines) + "\n"


def answer(outcome: Outcome) -> str:
    best = outcome.winner()
    if best is None:
        return "**No candidate completed its trial**: see the rows below for why."
    saved = f"; saved as `{outcome.winner_file}`" if outcome.winner_file else ""
    verdict = outcome.verdict
    if verdict is not None:
        return f"**{certainty(verdict)}**{saved}."
    how = "predicted by the planner's time floor (no trial ran)" if outcome.predicted else \
        f"measured over {best['timed_steps']} timed steps, not re-measured against another ({outcome.why_no_rounds})"
    return f"**Fastest: {best['config']} (grad_accum {best['grad_accum']}), {best['samples_per_s']:.4g} samples/s, " \
           f"{how}**{saved}."


# Rows that would run: a trial that completed or was stopped at a rung, one ranked or left unrun, or one
# dropped only because its twin without gradient checkpointing fits (it fits too).
_WOULD_RUN = (Status.OK, Status.PRUNED, PREDICTED, "not_run", SLOWER)


def smallest_peak(rows: list[dict]) -> str:
    """What to train with when memory is all that matters: the lowest GPU peak nvidia-smi measured among the
    trials, else the lowest planned peak among the candidates that would run (`zerotune plan --all`'s
    "smallest peak" over the tune's space)."""
    fits = [r for r in rows if r["status"] in _WOULD_RUN]
    measured = [r for r in fits if r["gpu_peak_process_mib"]]
    if measured:
        least = min(measured, key=lambda r: (r["gpu_peak_process_mib"], r["candidate"]))
        return (f"Smallest peak: {least['config']} (grad_accum {least['grad_accum']}), "
                f"{least['gpu_peak_process_mib']:,.0f} MiB measured (nvidia-smi, the job's processes).")
    planned = [r for r in fits if r["plan_peak_mib"]]
    if not planned:
        return "Smallest peak: none known (no candidate that would run has a measured or planned peak)."
    least = min(planned, key=lambda r: (r["plan_peak_mib"], r["candidate"]))
    return (f"Smallest peak: {least['config']} (grad_accum {least['grad_accum']}), {least['plan_peak_mib']:,.0f} "
            "MiB predicted by the planner (unmeasured: no trial measured a GPU peak).")


def certainty(verdict: Verdict) -> str:
    """One line: "winner: ..., ratio to the runner-up" or "tie among ...; chosen: ... (the cheapest)"."""
    chosen = verdict.chosen
    runs = len(chosen.rounds)
    if verdict.is_tie:
        names = "; ".join(f"{f.screened.candidate.label()} ({f.median:.4g})" for f in verdict.tied)
        return (f"tie among {len(verdict.tied)} (medians of {runs} rounds, samples/s): {names}. Chosen, as the "
                f"cheapest of them (smallest predicted peak, then no offload, then the lowest stage): "
                f"{chosen.screened.candidate.label()}{resampled(verdict)}{crowded(verdict)}")
    runner = verdict.runner_up()
    if runner is None:
        versus = ""
    elif not runner.ratios:
        versus = f"; the runner-up {runner.other.screened.candidate.label()} failed its rounds"
    else:
        versus = (f"; {runner.median:.3g}x the runner-up {runner.other.screened.candidate.label()} (rounds "
                  f"{runner.low:.3g}-{runner.high:.3g}x)")
    return (f"winner: {chosen.screened.candidate.label()}, {chosen.median:.4g} samples/s (median of {runs} rounds)"
            f"{versus}{resampled(verdict)}{crowded(verdict)}")


def resampled(verdict: Verdict) -> str:
    """How often the rounds, drawn again, write the chosen one, and what they write otherwise (the two most often)."""
    if not verdict.resampled:
        return ""
    labels = {f.screened.number: f.screened.candidate.label() for f in verdict.finalists}
    share = verdict.resampled.get(verdict.chosen.screened.number, 0.0)
    others = [f"{labels[n] if n is not None else 'none'} {s:.0%}"
              for n, s in verdict.resampled.items() if n != verdict.chosen.screened.number][:2]
    return (f"; its rounds, drawn again {RESAMPLES:,} times, write it in {share:.0%}"
            + (f" (otherwise {'; '.join(others)})" if others else ""))


def crowded(verdict: Verdict) -> str:
    """Where the search left more near its best than were re-measured, say so, and how to re-measure them all."""
    measured = len(verdict.finalists)
    if verdict.within_noise <= measured:
        return ""
    return (f"; the search could not tell {verdict.within_noise} trials from its best and {measured} were "
            f"re-measured, so another run may write another (hydra.sweeper.finalists={verdict.within_noise} "
            "re-measures them all)")


def paired_table(verdict: Verdict | None) -> list[str]:
    if verdict is None:
        return []
    by_number = {c.other.screened.number: c for c in verdict.comparisons}
    tied = {f.screened.number for f in verdict.tied}
    extended = max(len(f.rounds) for f in verdict.finalists) - min(len(f.rounds) for f in verdict.finalists)
    more = (f" A close call (a lead past the allowance in the median, but level in a round) ran {extended} more "
            "rounds, the fastest and it only." if extended else "")
    lines = ["## finalists, paired", "",
             "Each finalist ran once per round, the order reversed every other round; ratio: the fastest's "
             f"samples/s over this one's in the same round (median, and min-max over the rounds).{more} Written, "
             f"rounds drawn again: the rounds resampled with replacement {RESAMPLES:,} times, the verdict taken "
             "each time; how often it writes this one.", "",
             "| # | config | rounds (samples/s) | median | ratio (median) | ratio spread | verdict | "
             "written, rounds drawn again |", "|---|---|---|---|---|---|---|---|"]
    for f in verdict.finalists:
        number = f.screened.number
        comparison = by_number.get(number)
        ratio = f"{comparison.median:.3f}" if comparison and comparison.ratios else "-"
        spread = f"{comparison.low:.3f}-{comparison.high:.3f}" if comparison and comparison.ratios else "-"
        word = ("chosen" if f is verdict.chosen else "tied" if number in tied else "slower")
        if f is verdict.finalists[0]:
            word = "fastest" + (", chosen" if f is verdict.chosen else "")
        rounds = " ".join(_cell(v, "{:.4g}") for v in f.rounds)
        share = f"{verdict.resampled.get(number, 0.0):.0%}" if verdict.resampled else "-"
        lines.append(f"| {number} | {f.screened.candidate.label()} | {rounds} | {f.median:.4g} | {ratio} | "
                     f"{spread} | {word} | {share} |")
    measured = verdict.run_to_run_spread()
    if measured is not None:
        lines += ["", f"Run to run, one configuration's rounds varied by ±{measured:.1%} (the median over the "
                  f"finalists of half their range); `hydra.sweeper.min_spread` was {verdict.min_spread:.0%}. "
                  f"A win needed a lead of more than {verdict.allowed:.1%} in the median (the larger of the two), and "
                  "to be ahead in every round (in all but one, of five or more)."]
        if measured > verdict.min_spread:
            # a ratio of two such runs varies about twice as much; this is the least that allows for one run's
            suggested = min(math.ceil(measured * 100) / 100, 0.5)
            lines.append(f"This host's runs vary more than min_spread: `hydra.sweeper.min_spread={suggested:.2f}` "
                         "or more lets the search's pruning allow for it too.")
    return [*lines, ""]


def _cell(value, fmt: str = "{}", missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)


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

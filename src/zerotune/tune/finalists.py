"""After the search, the verdict: the finalists re-measured in rounds (a pair's ratio taken between runs minutes
apart, as a search's one-trial figures may differ by noise), the fastest against each of the others by round, and what
is written: the fastest, or the cheapest of those tied with it. Rounds drawn again (resampled_choices) say how sure."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from zerotune.tune.space import Screened, planned_peak_mib
from zerotune.tune.study import Trial, pooled_figures, shape


@dataclass
class Finalist:
    trial: Trial                  # its trial in the search
    rounds: list[float | None]    # samples/s of its run in each round (None: that run failed)

    @property
    def screened(self) -> Screened:
        return self.trial.screened

    @property
    def median(self) -> float:
        measured = [v for v in self.rounds if v]
        return statistics.median(measured) if measured else 0.0

    @property
    def failed_a_round(self) -> bool:
        """A run of it failed (out of memory, say): it cannot be the choice, however fast its other runs."""
        return not self.rounds or any(not v for v in self.rounds)


@dataclass
class Comparison:
    """The fastest finalist against another: fastest / other, round by round."""
    other: Finalist
    ratios: list[float]           # over the rounds both ran
    ahead: bool                   # more than Verdict.allowed in the median, and level in no round (one in 5 or more)
    close: bool = False           # ahead in the median, but level in a round too many: more rounds can tell

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan

    @property
    def low(self) -> float:
        return min(self.ratios) if self.ratios else math.nan

    @property
    def high(self) -> float:
        return max(self.ratios) if self.ratios else math.nan


@dataclass
class Verdict:
    finalists: list[Finalist]     # fastest (by median) first
    comparisons: list[Comparison]  # the fastest against each of the others, in that order
    tied: list[Finalist]          # the fastest and those it is not ahead of
    chosen: Finalist              # the cheapest of the tied (the fastest, where it tied with none)
    min_spread: float = 0.0       # hydra.sweeper.min_spread
    allowed: float = 0.0          # the median lead a win needed: min_spread, or the rounds' own spread
    within_noise: int = 0         # finalists the search's noise called for (within_noise()), limit aside
    # candidate number -> how often the rounds, drawn again, write it (resampled_choices); None: none written
    resampled: dict[int | None, float] = field(default_factory=dict)

    @property
    def is_tie(self) -> bool:
        return len(self.tied) > 1

    def run_to_run_spread(self) -> float | None:
        return run_to_run_spread(self.finalists)

    def runner_up(self) -> Comparison | None:
        return self.comparisons[0] if self.comparisons else None

    def close_calls(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.close]

    def deciding_close_calls(self) -> list[Comparison]:
        """The close calls whose outcome can change what is written: those cheaper than the fastest. A costlier
        one is never written, tie or not (the fastest is in every tie, and cheaper), so more rounds of it would
        only cost time."""
        fastest = cost(self.finalists[0].screened)
        return [c for c in self.close_calls() if cost(c.other.screened) < fastest]


def run_to_run_spread(finalists: list[Finalist]) -> float | None:
    """How much one configuration's runs varied, here: the median over the finalists of half their rounds'
    range, relative to their median (None with fewer than two measured rounds each)."""
    spreads = [(max(v) - min(v)) / 2 / statistics.median(v) for v in
               ([x for x in f.rounds if x] for f in finalists) if len(v) > 1]
    return statistics.median(spreads) if spreads else None


def pick(trials: list[Trial], min_spread: float, limit: int) -> list[Trial]:
    """The fastest complete trials by pooled figure, at most `limit`: the best, the runner-up (so the winner's lead
    is measured in pairs too), the next whose figure could reach the best's (figure x (1 + spread) >= best x (1 -
    its spread), each its last rung's, floored by min_spread), then, room left, those within twice the spreads;
    then each one's cheapest variant (cheaper_variants), beyond the limit. By speed, not cost: cheap trials at the
    edge of the noise, re-measured first, mostly proved slower, and now and then tied by luck and were written
    (README workload: micro batch 8, at 0.72-0.74 of the grid's best)."""
    complete, within, reaches = _near_best(trials, min_spread)
    near = [t for t in complete[2:] if t not in within and reaches(t, 2)]
    fastest = [*complete[:2], *within, *near][:limit]
    return [*fastest, *cheaper_variants(fastest, [t for t in complete if reaches(t, 1)])]


def cheaper_variants(fastest: list[Trial], candidates: list[Trial]) -> list[Trial]:
    """For each of `fastest`, the cheapest of `candidates` (by cost) of the same shape (pooled.shape: processes x
    micro batch), where it is cheaper and not already there. A shape's variants differ in how ZeRO holds the
    model, so mostly in memory: where the fastest shape ties, the verdict writes its cheapest variant, and that
    one must have been re-measured to be written. Which variants came out fastest in the search was chance
    (README workload: stage 0 at 2 x 16, the cheapest of its shape and tied with the fastest whenever
    re-measured, fell to 11th or 14th of 43 by pooled figure in 2 of 9 runs, and a costlier stage was written)."""
    added: list[Trial] = []
    for trial in fastest:
        same = [t for t in candidates if shape(t) == shape(trial)]
        cheapest = min(same, key=lambda t: cost(t.screened), default=trial)
        if cost(cheapest.screened) < cost(trial.screened) and cheapest not in fastest and cheapest not in added:
            added.append(cheapest)
    return added


def within_noise(trials: list[Trial], min_spread: float) -> int:
    """How many complete trials pick() would re-measure with no limit: the best, the runner-up, and those whose
    figure could reach the best's. More than the finalists: another run may re-measure, and write, others."""
    complete, within, _ = _near_best(trials, min_spread)
    return min(len(complete), 2) + len(within)


def _near_best(trials: list[Trial], min_spread: float) -> tuple[list[Trial], list[Trial], Callable[[Trial, int], bool]]:
    """The complete trials by pooled figure, best first; those after the first two whose figure could reach the
    best's; and that test, for a number of spreads: figure x (1 + widths x spread) >= best x (1 - widths x its
    spread), each spread floored by min_spread."""
    figures = pooled_figures(trials)
    complete = sorted((t for t in trials if t.number in figures), key=lambda t: -figures[t.number])

    def reaches(trial: Trial, widths: int) -> bool:
        best = complete[0]
        floor = figures[best.number] * (1 - widths * max(best.spread, min_spread))
        return figures[trial.number] * (1 + widths * max(trial.spread, min_spread)) >= floor

    return complete, [t for t in complete[2:] if reaches(t, 1)], reaches


def decide(finalists: list[Finalist], min_spread: float) -> Verdict | None:
    """The fastest by median among those whose every round ran; the others it is not ahead of (in the median by
    more than the spread allowed: min_spread, or the rounds' own run-to-run spread where larger; and in every
    round, or all but one of five or more) tie with it, and the cheapest of those is chosen: the smallest
    predicted peak, then no offload, then the lowest stage. A finalist with a failed round is behind them all.
    None where none ran all its rounds (the search's best stands)."""
    ranked = sorted(finalists, key=lambda f: (f.failed_a_round, -f.median, f.screened.number))
    fastest, comparisons = ranked[0], []
    if fastest.failed_a_round:
        return None
    allowed = max(min_spread, run_to_run_spread([f for f in ranked if not f.failed_a_round]) or 0.0)
    for other in ranked[1:]:
        # Paired by round; a close call's extra rounds pair only where both ran them.
        ratios = [a / b for a, b in zip(fastest.rounds, other.rounds, strict=False) if a and b]
        # The median's lead, not the worst round's: a real lead near the allowance, measured by one slow round
        # below it, would turn into a tie in some runs and not in others. A round the other was level in
        # makes it a close call instead: three rounds cannot tell a lead from a lucky streak. (A round merely
        # within the allowance is not one: on a noisy host its extra rounds tied a configuration at 0.86 of the
        # best by luck, and it was written.)
        leads = bool(ratios) and statistics.median(ratios) > 1 + allowed
        level = sum(r <= 1 for r in ratios)
        ahead = other.failed_a_round or (leads and level <= (len(ratios) - 1) // 4)
        comparisons.append(Comparison(other, ratios, ahead, close=leads and not ahead))
    tied = [fastest, *(c.other for c in comparisons if not c.ahead)]
    return Verdict(ranked, comparisons, tied, min(tied, key=lambda f: cost(f.screened)), min_spread, allowed)


RESAMPLES = 1000  # a share near 50% to about ±1.6% (one standard error)


def resampled_choices(verdict: Verdict, seed: int = 0) -> dict[int | None, float]:
    """How often each finalist is written when the rounds are drawn again, with replacement, from those measured
    and the verdict is taken again (a bootstrap; seeded, so one tune.md reads the same each time): the share of
    resamples by candidate number, most often first. A round, not a run, is the unit drawn: a round's runs share
    its moment on the host. A close call's extra rounds are drawn among themselves. This is what the rounds
    alone leave open; which trials became finalists is the search's part (Verdict.within_noise)."""
    common = min(len(f.rounds) for f in verdict.finalists)
    longest = max(len(f.rounds) for f in verdict.finalists)
    rng = random.Random(seed)
    written: Counter[int | None] = Counter()
    for _ in range(RESAMPLES):
        drawn = [rng.randrange(common) for _ in range(common)]
        drawn += [rng.randrange(common, longest) for _ in range(longest - common)]
        again = decide([Finalist(f.trial, [f.rounds[i] for i in drawn if i < len(f.rounds)])
                        for f in verdict.finalists], verdict.min_spread)
        written[again.chosen.screened.number if again is not None else None] += 1
    return {number: n / RESAMPLES for number, n in written.most_common()}


def cost(screened: Screened) -> tuple:
    """What a configuration costs, least first: its predicted peak memory, offload, ZeRO stage."""
    knobs = screened.candidate.knobs
    peak = planned_peak_mib(screened.plan)
    stage = str(knobs.get("zero_stage", "0")).strip("'\"")
    return (peak if peak is not None else math.inf, str(knobs.get("offload", "none")) != "none",
            int(stage) if stage.isdigit() else 0, screened.number)

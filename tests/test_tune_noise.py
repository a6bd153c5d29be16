"""tune telling a win from noise, in-process: jobs that report through the study's journal as real ones do, timed
by a fake clock that injects noise (a whole run slower or faster, and each step's jitter). A tie is named as one
and the cheapest of the tied is written; a real win is a win, with its ratio; a noisy rung does not prune."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from zerotune.train.rungs import SPREAD_ATTR, SpreadHalvingPruner, TrialRungs, rate_spread
from zerotune.tune import finalists
from zerotune.tune.finalists import Finalist, decide
from zerotune.tune.outcome import Outcome, markdown
from zerotune.tune.space import KEPT, Candidate, Screened, TuneSettings, read_settings
from zerotune.tune.study import Trial, pooled_figures, run_trials
from zerotune.tune.sweep import remeasure

optuna.logging.set_verbosity(optuna.logging.WARNING)


def noisy_jobs(rates: dict[str, float], run_noise: float, step_noise: float, seed: int, log: list[str]):
    """A job per trial or round, in this process. Candidate `zero_stage=<k>` runs at rates[k] samples/s, times
    one factor for the whole run (uniform within ±run_noise) and one per step (±step_noise)."""
    rng = random.Random(seed)

    def launch(overrides: list[str], job: int) -> Path:
        given = dict(o.split("=", 1) for o in overrides)
        fields = {k.split(".", 1)[1]: given[k] for k in given if k.startswith("trial.")}
        trial = SimpleNamespace(**{**fields, **{k: int(fields[k]) for k in
                                                ("warmup_steps", "min_steps", "max_steps", "number")},
                                   "reduction_factor": int(fields.get("reduction_factor", 3)),
                                   "min_spread": float(fields["min_spread"])})
        log.append(f"{fields['study']}:{given['zero_stage']}")
        run_dir = Path(trial.storage).parent / str(job)
        run_dir.mkdir()
        rate = rates[given["zero_stage"]] * (1 + rng.uniform(-run_noise, run_noise))
        rungs, timer = TrialRungs(trial, is_main=True), SimpleNamespace(durations=[], samples=[])
        status, steps = "ok", int(given["train.max_steps"])
        for step in range(1, steps + 1):
            timer.durations.append(8 / (rate * (1 + rng.uniform(-step_noise, step_noise))))
            timer.samples.append(8)
            if rungs.stop_here(step, timer):
                status, steps = "pruned", step
                break
        (run_dir / "summary.json").write_text(json.dumps({"status": status, "steps": steps}))
        return run_dir

    return launch


def kept(*stages: str, peaks: dict[str, float] | None = None, offload: dict[str, str] | None = None) -> list[Screened]:
    return [Screened(i, Candidate({"zero_stage": s, "offload": (offload or {}).get(s, "none")}, 1), KEPT,
                     plan={"run_peak_mib": (peaks or {}).get(s, 1000.0)}) for i, s in enumerate(stages)]


SETTINGS = TuneSettings(warmup_steps=1, min_steps=4, reduction_factor=3, max_steps=12, min_spread=0.05,
                        finalists=4, pair_rounds=3, pair_steps=8)


def tune(tmp_path: Path, screened: list[Screened], launch, settings: TuneSettings = SETTINGS) -> Outcome:
    """What tune_sweep does after the screen: the search, then the finalists' rounds."""
    outcome = Outcome("model=tiny", 8, "here", screened)
    outcome.trials = run_trials(settings, screened, ["model=tiny"], tmp_path, launch)
    outcome.verdict = remeasure(settings, outcome.trials, ["model=tiny"], tmp_path, launch)
    return outcome


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tie_is_named_and_the_cheapest_of_the_tied_is_written(tmp_path, seed):
    """Stages 0 and 2 run at one rate under ±15% run noise (stage 2 offloads, and needs more memory); stage 3
    is half as fast. With min_spread at the host's run-to-run noise, whichever measures faster, the two tie,
    and stage 0 (cheapest) is written."""
    log: list[str] = []
    screened = kept("2", "0", "3", peaks={"0": 900.0, "2": 1200.0, "3": 800.0}, offload={"2": "cpu"})
    outcome = tune(tmp_path, screened, noisy_jobs({"0": 100.0, "2": 100.0, "3": 50.0}, 0.15, 0.03, seed, log),
                   replace(SETTINGS, min_spread=0.15))
    verdict = outcome.verdict
    assert verdict is not None and verdict.is_tie
    assert {f.screened.candidate.knobs["zero_stage"] for f in verdict.tied} == {"0", "2"}
    assert verdict.chosen.screened.candidate.knobs["zero_stage"] == "0"
    assert outcome.winner()["config"] == "zero_stage=0 offload=none"
    rounds = [entry for entry in log if entry.startswith("rounds:")]
    # A B, B A, A B. Seed 1 had a close call (level in a round, 18% behind in the median) of stage 2 against
    # stage 0, the fastest: stage 2 costs more, so it is never written, tie or not, and gets no more rounds.
    assert len(rounds) == 6 and set(rounds) == {"rounds:0", "rounds:2"}
    assert rounds[2:4] == rounds[1::-1] and rounds[4:6] == rounds[:2]
    assert bool(verdict.close_calls()) == (seed == 1) and not verdict.deciding_close_calls()
    text = markdown(outcome, outcome.rows())
    assert "## finalists, paired" in text and "tie among 2" in text and "Chosen, as the cheapest" in text
    assert "| 1 | zero_stage=0 offload=none |" in text
    measured = verdict.run_to_run_spread()
    assert measured is not None and 0 < measured < 0.3  # uniform ±15% per run, ±3% per step
    assert f"rounds varied by ±{measured:.1%}" in text
    assert ("min_spread=0." in text) == (measured > 0.15)  # the setting that would allow for it, where needed


def test_a_real_win_is_a_win_with_its_ratio(tmp_path):
    log: list[str] = []
    screened = kept("0", "2", peaks={"0": 1200.0, "2": 900.0})
    outcome = tune(tmp_path, screened, noisy_jobs({"0": 150.0, "2": 100.0}, 0.05, 0.03, 4, log))
    verdict = outcome.verdict
    assert verdict is not None and not verdict.is_tie
    assert verdict.chosen.screened.candidate.knobs["zero_stage"] == "0"  # the faster, though not the cheaper
    runner = verdict.runner_up()
    assert runner is not None and runner.ahead and 1.3 < runner.low <= runner.median <= runner.high < 1.75
    assert "winner: zero_stage=0 offload=none" in markdown(outcome, outcome.rows())


def test_the_tuned_file_says_how_sure(tmp_path, monkeypatch):
    from zerotune.tune.outcome import save_winner

    monkeypatch.chdir(tmp_path)
    screened = kept("0", "2", peaks={"0": 1200.0, "2": 900.0})
    outcome = tune(tmp_path, screened, noisy_jobs({"0": 150.0, "2": 100.0}, 0.05, 0.03, 4, []))
    text = save_winner(outcome, ["model=tiny"], "noise", tmp_path).read_text()
    runner = outcome.verdict.runner_up()
    assert "How sure: winner: zero_stage=0 offload=none, " in text
    assert f"its rounds, drawn again 1,000 times, write it in {outcome.verdict.resampled[0]:.0%}" in text
    assert f"{runner.median:.3g}x the runner-up zero_stage=2 offload=none (rounds {runner.low:.3g}-{runner.high:.3g}x)" \
        in text
    tie = decide([Finalist(outcome.verdict.finalists[0].trial, [100.0, 90.0, 100.0]),
                  Finalist(outcome.verdict.finalists[1].trial, [95.0, 100.0, 96.0])], 0.05)
    outcome.verdict = tie
    text = save_winner(outcome, ["model=tiny"], "noise", tmp_path).read_text()
    assert "How sure: tie among 2" in text and "zero_stage=2" in text.split("How sure:")[1].split("\n")[0]


def test_a_noisy_rung_does_not_prune_where_halving_alone_would():
    """Two trials at a rung: the second behind by 10%, but its figure spreads ±15%. Optuna's successive halving
    stops it; the spread-aware one does not, and does stop one behind by more than both spreads."""
    def study_with(second: float, spread: float, pruner) -> bool:
        study = optuna.create_study(direction="maximize", pruner=pruner)
        first = study.ask()
        first.set_user_attr(SPREAD_ATTR.format(4), 0.02)
        first.report(100.0, 4)
        assert not first.should_prune()  # where Optuna's pruner records the rung it completed
        trial = study.ask()
        trial.set_user_attr(SPREAD_ATTR.format(4), spread)
        trial.report(second, 4)
        return trial.should_prune()

    assert study_with(90.0, 0.15, optuna.pruners.SuccessiveHalvingPruner(min_resource=4, reduction_factor=3))
    assert not study_with(90.0, 0.15, SpreadHalvingPruner(3, 0.05))
    assert study_with(70.0, 0.15, SpreadHalvingPruner(3, 0.05))          # 70 x 1.15 < 100 x 0.95
    assert not study_with(92.0, 0.0, SpreadHalvingPruner(3, 0.05))       # min_spread floors a spread of 0


def test_a_noisy_search_keeps_the_best_through_its_rungs(tmp_path):
    """With ±20% step jitter, a 4-step first rung cannot tell 100 from 90 samples/s: both reach the last rung."""
    log: list[str] = []
    screened = kept("0", "2", "3")
    trials = run_trials(SETTINGS, screened, ["model=tiny"], tmp_path,
                        noisy_jobs({"0": 90.0, "2": 100.0, "3": 95.0}, 0.0, 0.2, 7, log))
    assert {t.status for t in trials} == {"ok"}


def test_rate_spread_is_the_t_interval_of_the_step_rates():
    assert rate_spread([0.1, 0.1, 0.1], [8, 8, 8]) == 0.0
    assert rate_spread([0.1], [8]) == 1.0  # one step: no spread to measure
    # rates 10 and 12: mean 11, sd sqrt(2); t(0.95, 1 dof) = 6.3138; half-width 6.3138 x sqrt(2) / sqrt(2)
    assert rate_spread([1.0, 1.0], [10, 12]) == pytest.approx(6.3138 / 11, rel=1e-4)


def test_finalists_are_those_within_the_spread_of_the_best():
    def trial(number: int, figure: float, spread: float, status: str = "ok") -> Trial:
        # each its own configuration, and too few trials for the knobs model: the figures stand alone
        return Trial(kept(str(number))[0], number, status, figure, 12, {12: figure}, {}, 1.0, spread)

    trials = [trial(0, 100.0, 0.02), trial(1, 92.0, 0.02), trial(2, 86.0, 0.02), trial(3, 99.0, 0.3, "pruned"),
              trial(4, 91.0, 0.02), trial(5, 70.0, 0.4)]
    # the runner-up always; 91 x 1.05 >= 100 x 0.95; 86 x 1.05 < 95; 70 x 1.4 >= 95; a pruned trial is no finalist
    assert [t.number for t in finalists.pick(trials, 0.05, 4)] == [0, 1, 4, 5]
    assert [t.number for t in finalists.pick(trials, 0.05, 2)] == [0, 1]
    # room left: the next fastest within twice the spreads (86 x 1.1 >= 100 x 0.9), not the pruned one
    assert [t.number for t in finalists.pick(trials, 0.05, 6)] == [0, 1, 4, 5, 2]
    far = [trial(0, 100.0, 0.02), trial(1, 99.0, 0.02), trial(2, 81.0, 0.02), trial(3, 60.0, 0.02)]
    assert [t.number for t in finalists.pick(far, 0.1, 4)] == [0, 1, 2]  # 81 x 1.2 >= 80; 60 x 1.2 < 80
    assert [t.number for t in finalists.pick(trials[:1], 0.05, 4)] == [0]


@pytest.mark.parametrize(("params", "key"), [({"min_spread": 1.5}, "hydra.sweeper.min_spread"),
                                             ({"pair_rounds": -1}, "hydra.sweeper.pair_rounds"),
                                             ({"extra_rounds": "2"}, "hydra.sweeper.extra_rounds"),
                                             ({"finalists": 0}, "hydra.sweeper.finalists")])
def test_bad_noise_settings_name_their_key_and_the_fix_works(params, key):
    from zerotune.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        read_settings(params)
    assert err.value.key == key
    setting, value = err.value.fix.split("=", 1)
    assert isinstance(read_settings({setting.split(".")[-1]: float(value) if "." in value else int(value)}),
                      TuneSettings)



def test_a_finalist_that_failed_a_round_is_not_chosen():
    """A configuration that ran out of memory in one of its rounds is behind the others, however fast its other
    rounds; where none ran all its rounds, there is no verdict (the search's best stands)."""
    trials = [Trial(s, s.number, "ok", 100.0, 12, {12: 100.0}, {}, 1.0, 0.02) for s in kept("0", "2")]
    verdict = decide([Finalist(trials[0], [200.0, None, 210.0]), Finalist(trials[1], [100.0, 101.0, 99.0])], 0.05)
    assert verdict is not None and verdict.chosen.trial is trials[1] and not verdict.is_tie
    assert verdict.comparisons[0].ahead
    assert decide([Finalist(trials[0], [None, None, None]), Finalist(trials[1], [100.0, None, 99.0])], 0.05) is None


def test_a_lead_inside_the_rounds_own_spread_is_a_tie():
    """min_spread 3%, but the rounds themselves varied by about ±5.9% run to run: a median lead of 4% is inside
    that, so the two tie (with min_spread alone it would have been a win)."""
    trials = [Trial(s, s.number, "ok", 100.0, 12, {12: 100.0}, {}, 1.0, 0.02)
              for s in kept("0", "2", peaks={"0": 1200.0, "2": 900.0})]
    fastest, other = Finalist(trials[0], [100.0, 112.0, 104.0]), Finalist(trials[1], [96.0, 108.0, 100.0])
    verdict = decide([fastest, other], 0.03)
    assert verdict is not None and verdict.is_tie and verdict.chosen is other  # the cheaper of the two
    assert verdict.allowed == pytest.approx(((112 - 100) / 2 / 104 + (108 - 96) / 2 / 100) / 2)
    assert verdict.comparisons[0].median == pytest.approx(1.04)
    steady = decide([Finalist(trials[0], [100.0, 101.0, 100.0]), Finalist(trials[1], [96.0, 96.5, 96.0])], 0.03)
    assert steady is not None and not steady.is_tie and steady.allowed == 0.03  # steady rounds: min_spread rules
    assert f"A win needed a lead of more than {verdict.allowed:.1%}" in paired_table_text(verdict)


def test_the_rounds_drawn_again_say_how_often_they_write_the_same():
    """The cheaper is 5.3%, 13.6% and 8.7% behind in three rounds (min_spread 10%, rounds steadier than that): a
    tie, the cheaper written. Drawn again, the median passes 10% where the 13.6% round is drawn twice or more:
    7 of the 27 equally likely draws. So the rounds write the cheaper in 20/27 of resamples, the fastest in 7/27;
    a lead in every round writes the fastest in all of them."""
    trials = [Trial(s, s.number, "ok", 100.0, 12, {12: 100.0}, {}, 1.0, 0.02)
              for s in kept("0", "2", peaks={"0": 1200.0, "2": 900.0})]
    verdict = decide([Finalist(trials[0], [100.0, 100.0, 100.0]), Finalist(trials[1], [95.0, 88.0, 92.0])], 0.10)
    assert verdict is not None and verdict.is_tie and verdict.chosen.trial is trials[1]
    shares = finalists.resampled_choices(verdict)
    assert list(shares) == [1, 0]  # most often first
    assert shares[1] == pytest.approx(20 / 27, abs=0.05) and shares[0] == pytest.approx(7 / 27, abs=0.05)
    assert finalists.resampled_choices(verdict) == shares  # seeded: one tune.md reads the same each time
    text = markdown(Outcome("model=tiny", 8, "here", [t.screened for t in trials], trials,
                            verdict=replace(verdict, resampled=shares)), [])
    assert f"drawn again 1,000 times, write it in {shares[1]:.0%} (otherwise zero_stage=0 offload=none " \
           f"{shares[0]:.0%})" in text
    assert f"| fastest | {shares[0]:.0%} |" in text and f"| chosen | {shares[1]:.0%} |" in text
    clear = decide([Finalist(trials[0], [150.0, 140.0, 145.0]), Finalist(trials[1], [95.0, 88.0, 92.0])], 0.10)
    assert clear is not None and finalists.resampled_choices(clear) == {0: 1.0}


def test_a_clear_lead_is_a_win_though_one_round_came_close():
    """A lead of 20% in the median, 7% in one slow round, min_spread 10%: a win. Judged by its worst round it
    would tie in some runs and win in others; a round the other won is a tie, whatever the median."""
    trials = [Trial(s, s.number, "ok", 100.0, 12, {12: 100.0}, {}, 1.0, 0.02)
              for s in kept("0", "2", peaks={"0": 1200.0, "2": 900.0})]
    verdict = decide([Finalist(trials[0], [120.0, 107.0, 121.0]), Finalist(trials[1], [100.0, 100.0, 100.0])], 0.10)
    assert verdict is not None and not verdict.is_tie and verdict.chosen.trial is trials[0]
    split = decide([Finalist(trials[0], [130.0, 95.0, 125.0]), Finalist(trials[1], [100.0, 100.0, 100.0])], 0.10)
    assert split is not None and split.is_tie and split.chosen.trial is trials[1]


def paired_table_text(verdict) -> str:
    from zerotune.tune.outcome import paired_table

    return "\n".join(paired_table(verdict))


def test_the_fastest_within_the_spread_are_the_finalists_when_there_are_too_many():
    """Five complete trials within the spread of the best, each its own micro batch, room for three finalists:
    the three fastest, not the cheapest (the 300 MiB one at micro batch 4, slowest of the five, at the edge):
    the rounds tell the fastest from its nearest rivals, and the verdict writes the cheapest of those that tie."""
    micro = dict(zip("01234", ["32", "16", "64", "48", "4"], strict=True))
    screened = [replace(s, candidate=Candidate({**s.candidate.knobs, "train.batch_size": micro[str(s.number)]}, 1))
                for s in kept("0", "1", "2", "3", "4",
                              peaks={"0": 500.0, "1": 500.0, "2": 900.0, "3": 800.0, "4": 300.0})]
    trials = [Trial(s, s.number, "ok", figure, 12, {12: figure}, {}, 1.0, 0.02)
              for s, figure in zip(screened, [100.0, 99.0, 98.0, 97.0, 96.0], strict=True)]
    assert [t.number for t in finalists.pick(trials, 0.05, 3)] == [0, 1, 2]
    assert [t.number for t in finalists.pick(trials, 0.05, 4)] == [0, 1, 2, 3]
    assert finalists.within_noise(trials, 0.05) == 5  # the crowd line's count, and the limit that takes them all
    assert [t.number for t in finalists.pick(trials, 0.05, 5)] == [0, 1, 2, 3, 4]


def test_each_finalists_cheapest_variant_of_its_shape_is_re_measured_too():
    """Nine trials, three shapes (processes x micro batch), too few for the knobs model. The search measured
    stage 0 at 2 x 16, the cheapest of the fastest shape, low (85, sixth): it joins the four fastest as the
    cheapest variant of their shape, beyond the limit, for the verdict to write where that shape ties. The 2 x 8
    trials, cheaper still but another shape, do not; nor does a variant outside the spread, nor a cheaper one
    already among the fastest."""
    shapes = {"a": ("2", "16"), "b": ("1", "32"), "c": ("2", "8")}
    specs = [("1", "a", 100.0, 95.0), ("2", "a", 99.0, 100.0), ("0", "b", 98.0, 160.0), ("1", "b", 97.0, 165.0),
             ("2", "b", 96.0, 170.0), ("0", "a", 85.0, 90.0), ("0", "c", 88.0, 60.0), ("1", "c", 87.0, 65.0),
             ("2", "c", 60.0, 70.0)]
    trials = []
    for number, (stage, name, figure, peak) in enumerate(specs):
        processes, micro = shapes[name]
        knobs = {"zero_stage": stage, "offload": "none", "launch.num_processes": processes,
                 "train.batch_size": micro}
        screened = Screened(number, Candidate(knobs, 1), KEPT, plan={"run_peak_mib": peak})
        trials.append(Trial(screened, number, "ok", figure, 12, {12: figure}, {}, 1.0, 0.02))
    assert pooled_figures(trials)[5] == 85.0  # the figures stand alone
    assert [t.number for t in finalists.pick(trials, 0.1, 4)] == [0, 1, 2, 3, 5]
    # 2 x 16 at stage 0 outside the spread (60 x 1.1 < 100 x 0.9): no variant to add
    slow = [replace(t, samples_per_s=60.0, rungs={12: 60.0}) if t.number == 5 else t for t in trials]
    assert [t.number for t in finalists.pick(slow, 0.1, 4)] == [0, 1, 2, 3]
    # the cheapest variant already among the fastest: nothing added
    assert [t.number for t in finalists.pick(trials, 0.1, 8)] == [0, 1, 2, 3, 4, 6, 7, 5]


def scripted_jobs(search: dict[str, float], rounds: dict[str, list[float]], log: list[str]):
    """Jobs in this process whose rates are given: candidate `zero_stage=<k>` runs at search[k] in the search,
    and at the next of rounds[k] in each of its rounds, every step alike."""
    pending = {stage: iter(rates) for stage, rates in rounds.items()}

    def launch(overrides: list[str], job: int) -> Path:
        given = dict(o.split("=", 1) for o in overrides)
        study, stage = given["trial.study"], given["zero_stage"]
        rate = search[stage] if study == "tune" else next(pending[stage])
        log.append(f"{study}:{stage}")
        return noisy_jobs({stage: rate}, 0.0, 0.0, 0, [])(overrides, job)

    return launch


@pytest.mark.parametrize(("fastest_more", "verdict_word"), [([122.0, 124.0], "win"), ([100.0, 98.0], "tie")])
def test_a_close_call_gets_more_rounds_before_it_is_judged(tmp_path, fastest_more, verdict_word):
    """Three rounds: a 25% lead in the median, but the other was level in one (130 95 125 against 100 100 100).
    The two, and only they, run extra_rounds more: a lead that holds in them is a win (level in 1 round of
    5); one that does not is a tie, and the cheaper is written."""
    log: list[str] = []
    screened = kept("0", "2", "3", peaks={"0": 1200.0, "2": 900.0, "3": 800.0})
    launch = scripted_jobs({"0": 110.0, "2": 105.0, "3": 100.0},
                           {"0": [130.0, 95.0, 125.0, *fastest_more], "2": [100.0, 100.0, 100.0, 100.0, 100.0],
                            "3": [60.0, 61.0, 60.0]}, log)
    outcome = tune(tmp_path, screened, launch, replace(SETTINGS, min_spread=0.10, extra_rounds=2))
    verdict = outcome.verdict
    assert verdict is not None
    rounds = [entry for entry in log if entry.startswith("rounds:")]
    assert len(rounds) == 9 + 4 and sorted(rounds[9:]) == ["rounds:0", "rounds:0", "rounds:2", "rounds:2"]
    fastest, other, slow = verdict.finalists
    assert [len(fastest.rounds), len(other.rounds), len(slow.rounds)] == [5, 5, 3]
    comparison = verdict.comparisons[0]
    assert comparison.other is other and len(comparison.ratios) == 5 and not comparison.close
    assert verdict.comparisons[1].ahead and not verdict.comparisons[1].close  # ahead in each of its 3
    if verdict_word == "win":
        assert comparison.ahead and not verdict.is_tie and verdict.chosen is fastest
    else:
        assert not comparison.ahead and verdict.is_tie and verdict.chosen is other  # the cheaper
    assert "ran 2 more rounds, the fastest and it only" in markdown(outcome, outcome.rows())
    # Drawn again, the extra rounds among themselves: only the two ever write; the slow one (cheapest) never.
    assert set(verdict.resampled) <= {0, 1} and sum(verdict.resampled.values()) == pytest.approx(1.0)
    assert verdict.resampled[verdict.chosen.screened.number] >= 0.5


def test_without_extra_rounds_a_close_call_stays_a_tie(tmp_path):
    log: list[str] = []
    screened = kept("0", "2", peaks={"0": 1200.0, "2": 900.0})
    launch = scripted_jobs({"0": 110.0, "2": 105.0}, {"0": [130.0, 95.0, 125.0], "2": [100.0, 100.0, 100.0]}, log)
    verdict = tune(tmp_path, screened, launch, replace(SETTINGS, min_spread=0.10, extra_rounds=0)).verdict
    assert verdict is not None and verdict.is_tie and verdict.comparisons[0].close
    assert sum(entry.startswith("rounds:") for entry in log) == 6


def test_a_search_crowded_past_the_finalists_says_so_and_how_to_measure_them_all(tmp_path):
    """Five configurations the search cannot tell apart, room for three finalists: the verdict says that another
    run may write another, and the setting it names re-measures all five."""
    screened = kept("0", "1", "2", "3", "4")
    search = {"0": 100.0, "1": 99.0, "2": 98.0, "3": 97.0, "4": 96.0}
    launch = scripted_jobs(search, {stage: [100.0] * 5 for stage in search}, [])
    outcome = tune(tmp_path, screened, launch, replace(SETTINGS, finalists=3))
    verdict = outcome.verdict
    assert verdict is not None and len(verdict.finalists) == 3 and verdict.within_noise == 5
    assert ("the search could not tell 5 trials from its best and 3 were re-measured, so another run may write "
            "another (hydra.sweeper.finalists=5 re-measures them all)") in markdown(outcome, outcome.rows())
    fixed = read_settings({"finalists": 5, "min_spread": SETTINGS.min_spread})
    assert len(finalists.pick(outcome.trials, fixed.min_spread, fixed.finalists)) == 5
    (tmp_path / "roomy").mkdir()
    roomy = tune(tmp_path / "roomy", screened, scripted_jobs(search, {s: [100.0] * 5 for s in search}, []),
                 replace(SETTINGS, finalists=5))
    assert roomy.verdict is not None and "could not tell" not in markdown(roomy, roomy.rows())


def test_a_low_search_figure_is_pooled_with_its_neighbours_into_the_finalists():
    """Eighteen configurations: three stages x two offloads x three (processes, micro batch) pairs. The speed is
    the pair's (2 x 16: 100, 1 x 32: 95, 2 x 8: 70 samples/s), less 10% with CPU offload. The search measured
    stage 0 at 2 x 16 without offload, the cheapest of the fast ones, at 76: outside the spreads of the best
    (76 x 1.1 < 100 x 0.9). The knobs model predicts it from the others, and pooled it is within them: the
    search can no longer tell it from its best, so it is counted in the crowd line's number, and the setting that
    line names re-measures it; no slow one is re-measured."""
    pairs = {"2x16": ("2", "16", 100.0), "1x32": ("1", "32", 95.0), "2x8": ("2", "8", 70.0)}
    trials, luck = [], [1.0, 0.98, 1.02, 0.99]
    combos = [(stage, offload, pair) for stage in "012" for offload in ("none", "cpu") for pair in pairs]
    for number, (stage, offload, pair) in enumerate(combos):
        processes, micro, rate = pairs[pair]
        rate *= 0.9 if offload == "cpu" else 1.0
        figure = 76.0 if (stage, offload, pair) == ("0", "none", "2x16") else rate * luck[number % 4]
        knobs = {"zero_stage": stage, "offload": offload, "launch.num_processes": processes,
                 "train.batch_size": micro}
        peak = {"2x16": 90.0, "1x32": 160.0, "2x8": 60.0}[pair] + 5 * int(stage)
        screened = Screened(number, Candidate(knobs, 1), KEPT, plan={"run_peak_mib": peak})
        trials.append(Trial(screened, number, "ok", figure, 12, {12: figure}, {}, 1.0, 0.02))
    pooled = pooled_figures(trials)
    # its own 76, and the model's prediction from the others (its own figure pulls that down too)
    assert 80 < pooled[0] < 90 and pooled[0] * 1.1 >= max(pooled.values()) * 0.9
    assert all(pooled[t.number] < 80 for t in trials if t.screened.candidate.knobs["train.batch_size"] == "8")
    alone = max(t.samples_per_s or 0.0 for t in trials)
    assert 76.0 * 1.1 < alone * 0.9  # by its own figure, it was not within the spreads
    crowd = finalists.within_noise(trials, 0.1)
    chosen = [t.number for t in finalists.pick(trials, 0.1, crowd)]
    assert 0 in chosen and not any(trials[n].screened.candidate.knobs["train.batch_size"] == "8" for n in chosen)

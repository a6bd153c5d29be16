"""zerotune tune's parts, without training: the command line's fixed values and lists, the settings' checks,
the planner's screen, and the study (successive halving over jobs, a failed job scored worst)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.cli import compose_cfg
from zerotune.config.compose.settle import Settled, settle
from zerotune.config.errors import ConfigError
from zerotune.train.rungs import TrialRungs, journal, rung_steps
from zerotune.tune.outcome import Outcome, markdown, smallest_peak
from zerotune.tune.space import (
    INVALID,
    KEPT,
    NO_FIT,
    SAME,
    SLOWER,
    Candidate,
    Screened,
    TuneSettings,
    candidates,
    knob_values,
    read_command_line,
    read_settings,
    screen,
)
from zerotune.tune.study import JOURNAL, run_trials

SPACE = {"zero_stage": [0, 1, 2, 3], "offload": ["none", "cpu"], "train.batch_size": "auto",
         "train.gradient_checkpointing": [False, True], "deepspeed.overlap_comm": [False, True],
         "launch.num_processes": [1, 2]}


def _settled(overrides: list[str]) -> Settled:
    return settle(compose_cfg(*overrides), overrides)


def test_fixed_values_are_kept_and_lists_bound_the_search():
    line = read_command_line(["model=sdxl_tiny", "zero_stage='2'", "offload=none,cpu", "train.grad_accum=4"])
    assert line.workload == ["model=sdxl_tiny"] and line.fixed == {"zero_stage"}
    values = knob_values(line, SPACE, gpus=0)
    assert values["zero_stage"] == ["'2'"] and values["offload"] == ["none", "cpu"]
    found, dropped = candidates(values, global_batch=32, nnodes=1, batch_space="auto")
    assert dropped == []
    assert {c.knobs["zero_stage"] for c in found} == {"'2'"}           # the fixed value, in every candidate
    assert {c.knobs["offload"] for c in found} == {"none", "cpu"}      # only the listed ones
    # micro batch x accumulation x processes is the global batch in every candidate
    for c in found:
        assert int(c.knobs["train.batch_size"]) * c.grad_accum * int(c.knobs["launch.num_processes"]) == 32
    assert {c.knobs["train.batch_size"] for c in found if c.knobs["launch.num_processes"] == "1"} == {"32", "16", "8"}
    # 2 offloads x 3 micro batches x 2 checkpointing x 2 overlap x 2 process counts
    assert len(found) == 2 * 3 * 2 * 2 * 2


def test_stage_0_tries_zero_settings_once_and_odd_shares_are_dropped_with_reasons():
    line = read_command_line(["zero_stage=0,2", "offload=none", "train.gradient_checkpointing=false",
                              "launch.num_processes=1,3", "train.batch_size=4"])
    found, dropped = candidates(knob_values(line, SPACE, gpus=0), global_batch=8, nnodes=1, batch_space="auto")
    stage0 = [c for c in found if c.knobs["zero_stage"] == "0"]
    assert {c.knobs["deepspeed.overlap_comm"] for c in stage0} == {"false"}  # DeepSpeed reads it at stages 1-3
    assert {c.knobs["deepspeed.overlap_comm"] for c in found if c.knobs["zero_stage"] == "2"} == {"false", "true"}
    assert {c.grad_accum for c in found} == {2}
    assert dropped and all("does not divide among 3 ranks" in why for _, why in dropped)


def test_a_list_on_a_workload_key_names_the_key():
    with pytest.raises(ConfigError) as err:
        read_command_line(["resolution=64,128"])
    assert err.value.key == "resolution" and "one tune per value" in err.value.fix


@pytest.mark.parametrize(("params", "key"), [({"pruner": "median"}, "hydra.sweeper.pruner"),
                                             ({"min_steps": 0}, "hydra.sweeper.min_steps"),
                                             ({"min_steps": 8, "max_steps": 4}, "hydra.sweeper.max_steps"),
                                             ({"reduction_factor": 1}, "hydra.sweeper.reduction_factor"),
                                             ({"n_trial": 3}, "hydra.sweeper.n_trial")])
def test_bad_settings_name_their_key_and_the_fix_works(params, key):
    with pytest.raises(ConfigError) as err:
        read_settings(params)
    assert err.value.key == key
    fixed = {k: v for k, v in params.items() if f"hydra.sweeper.{k}" != key}
    if "=" in err.value.fix:  # a value to type: applying it makes the settings valid
        setting, value = err.value.fix.split("=", 1)[0].split(".")[-1], err.value.fix.split("=", 1)[1].split()[0]
        fixed[setting] = value if setting == "pruner" else int(value)
    assert isinstance(read_settings(fixed), TuneSettings)


def test_the_planner_drops_what_cannot_fit_and_the_validator_what_it_refuses():
    workload = ["model=tiny", "data=synthetic", "resolution=32", "launch.num_processes=1"]
    big = Candidate({"zero_stage": "2", "offload": "none", "train.batch_size": "64"}, 1)
    small = Candidate({"zero_stage": "2", "offload": "none", "train.batch_size": "4"}, 16)
    first = screen([big, small], workload, _settled, None)
    need = {s.candidate.knobs["train.batch_size"]: s.plan["host_need_mib"] for s in first}
    assert need["64"] > need["4"] > 0
    budget = int((need["64"] + need["4"]) / 2)  # room for the small one only
    cpu_stage0 = Candidate({"zero_stage": "0", "offload": "cpu", "train.batch_size": "4"}, 16)
    again = Candidate({"zero_stage": "'2'", "offload": "none", "train.batch_size": "4"}, 16)
    found = screen([big, small, cpu_stage0, again], [*workload, f"plan.host_mib={budget}"],
                   _settled, None)
    verdicts = {s.number: s for s in found}
    assert verdicts[0].verdict == NO_FIT and f"{budget:,.0f} MiB plan.host_mib" in verdicts[0].reason
    assert verdicts[1].verdict == KEPT
    assert verdicts[2].verdict == INVALID and "offload needs ZeRO stage 1 or more" in verdicts[2].reason
    assert verdicts[3].verdict == SAME and "candidate 1" in verdicts[3].reason


def test_checkpointing_is_tried_only_where_the_run_without_it_does_not_fit():
    workload = ["model=tiny", "data=synthetic", "resolution=32", "launch.num_processes=1", "zero_stage=2",
                "offload=none"]
    found = [Candidate({"train.batch_size": str(b), "train.gradient_checkpointing": gc}, 64 // b)
             for b in (64, 8) for gc in ("false", "true")]
    first = screen(found, workload, _settled, None)
    assert [s.verdict for s in first] == [KEPT, SLOWER, KEPT, SLOWER] and "candidate 0" in first[1].reason
    need = {(s.candidate.knobs["train.batch_size"], s.candidate.knobs["train.gradient_checkpointing"]):
            s.plan["host_need_mib"] for s in first}
    assert need[("64", "true")] < need[("64", "false")]
    budget = int((need[("64", "true")] + need[("64", "false")]) / 2)  # batch 64 fits only with checkpointing
    again = screen(found, [*workload, f"plan.host_mib={budget}"], _settled, None)
    assert [s.verdict for s in again] == [NO_FIT, KEPT, KEPT, SLOWER]


def test_rungs():
    assert rung_steps(4, 3, 36) == [4, 12, 36]
    assert rung_steps(4, 3, 40) == [4, 12, 36, 40]
    assert rung_steps(2, 2, 2) == [2]


def _fake_jobs(rates: dict[int, float | str], launched: list[list[str]]):
    """A job per trial, in this process: it reports as a real one does (TrialRungs, the study's journal), at
    `rates[candidate]` samples/s, or fails as `rates[candidate]` says, and writes its summary.json."""

    def launch(overrides: list[str], job: int) -> Path:
        launched.append(overrides)
        given = dict(o.split("=", 1) for o in overrides)
        trial = SimpleNamespace(**{k.split(".", 1)[1]: given[k] for k in given if k.startswith("trial.")})
        for key in ("warmup_steps", "min_steps", "reduction_factor", "max_steps", "number"):
            setattr(trial, key, int(getattr(trial, key)))
        run_dir = Path(trial.storage).parent / str(job)
        run_dir.mkdir()
        rate = rates[int(given["train.batch_size"])]
        status, steps = "ok", int(given["train.max_steps"])
        if isinstance(rate, str):  # fast through its first rung, then it fails
            status, steps, rate = rate, trial.warmup_steps + trial.min_steps + 1, 1000.0
        rungs, timer = TrialRungs(trial, is_main=True), SimpleNamespace(durations=[], samples=[])
        for step in range(1, steps + 1):
            timer.durations.append(32 / rate)
            timer.samples.append(32)
            if status == "ok" and rungs.stop_here(step, timer):
                status, steps = "pruned", step
                break
            if status != "ok" and step == trial.warmup_steps + trial.min_steps:
                rungs.stop_here(step, timer)  # reported, then failed before the next rung
        error = {"type": "OutOfMemoryError", "message": "injected"} if status == "oom" else None
        (run_dir / "summary.json").write_text(json.dumps({"status": status, "steps": steps, "error": error}))
        return run_dir

    return launch


@pytest.mark.parametrize("seed", [0, 3])
def test_the_study_stops_slow_trials_at_a_rung_and_scores_a_failure_worst(tmp_path, seed):
    rates = {1: 10.0, 2: 20.0, 4: "oom", 8: 40.0, 16: 30.0, 32: 5.0}
    kept = [Screened(i, Candidate({"train.batch_size": str(b)}, 32 // b), KEPT) for i, b in enumerate(rates)]
    settings = TuneSettings(warmup_steps=1, min_steps=1, reduction_factor=3, max_steps=9, seed=seed)
    launched: list[list[str]] = []
    trials = run_trials(settings, kept, ["model=tiny"], tmp_path, _fake_jobs(rates, launched))
    assert len(trials) == len(rates)          # the OOM did not end the search
    by_batch = {t.screened.candidate.knobs["train.batch_size"]: t for t in trials}
    assert by_batch["4"].status == "oom" and by_batch["4"].score == 0.0
    assert by_batch["8"].status == "ok" and by_batch["8"].timed_steps == 9
    assert by_batch["8"].samples_per_s == pytest.approx(40.0)
    assert any(t.status == "pruned" and t.timed_steps < 9 for t in trials)  # some stopped at a rung
    assert all(t.samples_per_s <= 40.0 + 1e-9 for t in trials if t.samples_per_s)
    assert all("model=tiny" in o and "checkpoint.final=false" in o and "train.max_steps=10" in o for o in launched)
    import optuna

    study = optuna.load_study(study_name="tune", storage=journal(str(tmp_path / JOURNAL)))
    states = {t.user_attrs["status"]: t.state.name for t in study.trials}
    assert states == {"ok": "COMPLETE", "pruned": "PRUNED", "oom": "COMPLETE"}
    assert min(t.value for t in study.trials if t.user_attrs["status"] == "oom") == 0.0
    outcome = Outcome("model=tiny", 32, "here", kept, trials)
    assert outcome.winner()["candidate"] == 3
    table = markdown(outcome, outcome.rows())
    assert "**Fastest: train.batch_size=8 (grad_accum 4), 40 samples/s" in table and "| oom |" in table


def test_zerotune_tune_is_a_tune_sweep():
    from zerotune.cli.command import tune_arguments

    assert tune_arguments(["model=sdxl", "--gpu", "h100", "-m"]) == \
        ["-m", "hydra/sweeper=tune", "model=sdxl", "hydra.sweeper.gpu=h100"]
    assert tune_arguments(["--gpu=rtx4090"]) == ["-m", "hydra/sweeper=tune", "hydra.sweeper.gpu=rtx4090"]


def test_the_screen_composes_each_candidate_as_hydra_does_whole():
    """The sweeper composes once per set of group choices and applies the rest as Hydra's last step does: every
    candidate's config must equal Hydra's own whole composition of the same command line."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    from hydra_plugins.zerotune_tune import TuneSweeper
    from zerotune.config import search
    from zerotune.config.compose.overrides import normalize_overrides

    workload = ["model=sdxl_tiny", "data=synthetic", "resolution=64", "optimizer.lr=3e-5", "train.seed=7"]
    line = read_command_line([*workload, "zero_stage=0,2,3", "offload=none,cpu", "launch.num_processes=1,2"])
    found, _ = candidates(knob_values(line, SPACE, gpus=0), global_batch=32, nnodes=1, batch_space="auto")
    chosen = found[::13]  # group choices and value knobs vary across these
    assert len({(c.knobs["zero_stage"], c.knobs["offload"]) for c in chosen}) >= 4
    with initialize_config_module(search.PACKAGED_CONF, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        sweeper = TuneSweeper()
        sweeper.hydra_context = SimpleNamespace(config_loader=loader)
        sweeper.config = SimpleNamespace(hydra=SimpleNamespace(job=SimpleNamespace(config_name="config")))
        for candidate in chosen:
            overrides = [*line.workload, *candidate.overrides()]
            whole = loader.load_configuration(config_name="config", run_mode=RunMode.MULTIRUN,
                                              overrides=normalize_overrides(overrides, search.current()))
            with open_dict(whole):
                del whole["hydra"]
            cached = sweeper._compose(overrides)
            assert OmegaConf.to_container(cached) == OmegaConf.to_container(whole), candidate.label()
            assert OmegaConf.to_container(cached, resolve=True) == OmegaConf.to_container(whole, resolve=True)
        assert len(sweeper._by_groups) < len(chosen)  # composed once per set of group choices


def test_the_report_names_the_smallest_peak_measured_else_planned():
    def plan(peak: float, floor: float) -> dict:
        return {"run_peak_mib": peak, "time_floor_s": floor, "terms": {"compute": floor}}

    screened = [Screened(0, Candidate({"zero_stage": "2"}, 1), KEPT, plan=plan(16_000.0, 1.0)),
                Screened(1, Candidate({"zero_stage": "3"}, 1), KEPT, plan=plan(8_800.0, 2.0)),
                Screened(2, Candidate({"zero_stage": "0"}, 1), NO_FIT, "above the card", plan=plan(100.0, 0.5)),
                Screened(3, Candidate({"zero_stage": "1"}, 1), INVALID, "refused")]
    outcome = Outcome("model=sdxl", 8, "here", screened, predicted=True)
    table = markdown(outcome, outcome.rows())
    assert "Fastest: zero_stage=2" in table  # the answer stays the fastest
    assert "Smallest peak: zero_stage=3 (grad_accum 1), 8,800 MiB predicted by the planner (unmeasured" in table
    rows = outcome.rows()
    for row in rows:  # trials on a card: what nvidia-smi measured decides, not the plan
        row.update(status="ok", gpu_peak_process_mib={0: 9_000.0, 1: 9_500.0}.get(row["candidate"]))
    assert smallest_peak(rows).startswith("Smallest peak: zero_stage=2 (grad_accum 1), 9,000 MiB measured")

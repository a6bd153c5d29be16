"""`zerotune train -m hydra/sweeper=tune` end to end, through Hydra and real jobs: a fixed value kept in every
trial, a trial that runs out of memory recorded as such while the search goes on, the report, and the winner's
experiment file, which then trains."""

from __future__ import annotations

import yaml

from tests.helpers.cli import read_summary, run_cli

OOM_OPTION = """# @package _global_
# offload=none, with an out-of-memory error injected at step 2: a trial that fails
offload: {device: none, params: false, path: null, pin_memory: true}
debug: {oom_at_step: 2}
"""


def test_a_tune_sweep_measures_records_an_oom_and_saves_a_winner_that_trains(tmp_path):
    (tmp_path / "zerotune" / "offload").mkdir(parents=True)
    (tmp_path / "zerotune" / "offload" / "oom_at_2.yaml").write_text(OOM_OPTION)
    sweep = tmp_path / "sweep"
    done = run_cli("-m", "hydra/sweeper=tune", "model=tiny", "data=synthetic", "resolution=8", "zero_stage=2",
                   "offload=none,oom_at_2", "launch.num_processes=1", "train.gradient_checkpointing=false",
                   "deepspeed.overlap_comm=false", "train.batch_size=8", "hydra.sweeper.global_batch=8",
                   "hydra.sweeper.warmup_steps=1", "hydra.sweeper.min_steps=1", "hydra.sweeper.max_steps=2",
                   "hydra.sweeper.name=e2e", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [read_summary(d) for d in sweep.iterdir() if (d / "summary.json").is_file()]
    assert sorted(s["status"] for s in summaries) == ["ok", "oom"]  # the OOM was recorded, the other trial ran
    # each trial's worker forked from the template that imported while the candidates were screened
    assert [(s.get("startup") or {}).get("worker_start") for s in summaries] == ["warm template"] * 2
    for d in (d for d in sweep.iterdir() if (d / ".hydra").is_dir()):
        overrides = yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text())
        assert "zero_stage='2'" in overrides and "train.batch_size=8" in overrides  # fixed: in every trial
    report = (sweep / "tune.md").read_text()
    assert "**Fastest: zero_stage=2 offload=none" in report and "| oom |" in report
    assert "tune [2/2]" in done.stderr + done.stdout                # a progress line per trial
    winner = tmp_path / "zerotune" / "experiment" / "tuned_e2e.yaml"
    body = yaml.safe_load(winner.read_text())
    assert {"override /offload": "none"} in body["defaults"] and body["train"]["grad_accum"] == 1
    assert body["reference"]["samples_per_s"] > 0
    trained = run_cli("experiment=tuned_e2e", "train.max_steps=2", f"hydra.run.dir={tmp_path / 'again'}",
                      cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = read_summary(tmp_path / "again")
    assert summary["status"] == "ok" and summary["choices"]["model"] == "tiny" and summary["steps"] == 2
    # a trial is a measurement: its figures in metrics.jsonl, no plot; a job of its own plots them
    trials = [d for d in sweep.iterdir() if (d / "summary.json").is_file()]
    assert all((d / "metrics.jsonl").is_file() and not (d / "telemetry.png").exists() for d in trials)
    assert (tmp_path / "again" / "telemetry.png").is_file()

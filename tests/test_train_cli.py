"""Training through the real CLI, as a user types it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import read_losses, read_summary, run_cli

QUICK = ["train.max_steps=4", "train.batch_size=8", "train.log_every=1", "evaluate.enabled=false",
         "scheduler=constant"]


def check_run(run_dir, stage: int, offload: str) -> dict:
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    assert summary["steps"] == 4
    assert summary["choices"]["zero_stage"] == stage and summary["choices"]["offload"] == offload
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage
    assert (run_dir / "config.yaml").is_file()
    losses = read_losses(run_dir)
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)
    return summary


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "offload"), [(0, "none"), (1, "none"), (2, "none"), (3, "none"),
                                                 (1, "cpu"), (2, "cpu"), (3, "cpu")])
def test_every_stage_trains(stage, offload, tmp_path):
    proc = run_cli(f"zero_stage={stage}", f"offload={offload}", *QUICK, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_run(tmp_path, stage, offload)
    if offload == "cpu":
        assert "offload_optimizer" in json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]
    assert summary["memory"]["gpu_peak_process_mib"] is None  # no GPU here: unmeasured, not 0


def test_zero2_cpu_offload_as_documented(offload_run):
    """`python train.py zero_stage=2 offload=cpu` exactly as the README types it (plus a short run, with
    checkpoints: tests/conftest.py)."""
    run_dir, proc = offload_run
    check_run(run_dir, 2, "cpu")
    assert "result: status ok" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_nvme_offload_swaps_to_the_folder(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    run = tmp_path / "run"
    proc = run_cli("zero_stage=3", "offload=nvme", f"offload.path={swap}", *QUICK, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_run(run, 3, "nvme")
    # Parameters and optimizer states were written to the swap folder while training.
    assert summary["memory"]["nvme_peak_mib"] > 0


@pytest.mark.slow  # 30 s; the default job's other tests run it shortened
def test_default_job_loss_falls(tmp_path):
    proc = run_cli("train.max_steps=60", "scheduler.warmup_steps=10", "train.log_every=10", "evaluate.per_class=4", "evaluate.steps=4",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["status"] == "ok" and summary["use_deepspeed"] is True
    losses = read_losses(tmp_path)
    assert summary["loss_last"] < 0.7 * summary["loss_first"], losses
    assert 0.0 <= summary["quality"]["digit_accuracy"] <= 1.0 and summary["quality"]["samples"] == 40
    assert (tmp_path / "samples" / "grid.png").stat().st_size > 0
    assert "digit accuracy" in proc.stdout + proc.stderr


def test_plain_accelerate_path_trains_at_stage_0(tmp_path):
    """Where DeepSpeed is unavailable, stage 0 trains with plain accelerate from the same dict."""
    proc = run_cli("zero_stage=0", "deepspeed.enabled=false", *QUICK, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = check_run(tmp_path, 0, "none")
    assert summary["use_deepspeed"] is False


@pytest.mark.slow
def test_multirun_sweep_over_stages(tmp_path):
    proc = run_cli("-m", "zero_stage=1,2", *QUICK, f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, stage in (("0", 1), ("1", 2)):
        check_run(tmp_path / job, stage, "none")


@pytest.mark.slow
def test_wandb_offline_run_records_what_was_logged(tmp_path):
    from tests.helpers.wandb_records import read_offline_run

    proc = run_cli("logger=wandb", "zero_stage=1", *QUICK, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_offline_run(tmp_path)
    # The run name is the overrides as typed (cut to 100 characters with a hash suffix when longer).
    assert record["name"].startswith("logger=wandb,zero_stage=1,train.max_steps=4,") and len(record["name"]) <= 100
    assert record["config"]["zero_stage"]["stage"] == 1 and record["config"]["model"]["name"] == "tiny"
    losses = [row["loss/train"] for row in record["history"] if "loss/train" in row]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses)
    assert all(row["memory/host_rss_mib"] > 0 for row in record["history"] if "loss/train" in row)
    assert any("samples" in row for row in record["history"]), "the sample/telemetry images were logged"
    assert record["summary"]["status"] == "ok" and record["summary"]["steps"] == 4
    assert record["exit_code"] == 0

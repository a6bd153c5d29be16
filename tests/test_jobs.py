"""A job that breaks is recorded, and never takes the sweep down with it."""

from __future__ import annotations

import pytest

from tests.helpers.cli import read_summary, run_cli

QUICK = ["train.max_steps=3", "train.batch_size=8", "train.log_every=1", "evaluate.enabled=false", "scheduler=constant"]


def test_oom_is_recorded_as_oom(tmp_path):
    proc = run_cli(*QUICK, "debug.oom_at_step=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1  # a broken job's exit, whatever broke it (a failure's too: cli/train.py)
    summary = read_summary(tmp_path)
    assert summary["status"] == "oom" and summary["error"]["type"] == "OutOfMemoryError"


@pytest.mark.slow
def test_hang_becomes_timeout(tmp_path):
    # Long enough for the worker to start and log step 1 on a busy machine, before it hangs.
    proc = run_cli(*QUICK, "debug.hang_at_step=1", "train.timeout_s=60", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1
    summary = read_summary(tmp_path)
    assert summary["status"] == "timeout" and "train.timeout_s=60" in summary["error"]["message"]
    assert any("step 1/3" in line for line in summary["error"]["log_tail"]), "the worker's last lines are kept"


def test_sweep_continues_past_a_failing_job(tmp_path):
    """The first job fails: it is recorded, with its peak and the step it logged, and the sweep goes on."""
    proc = run_cli("-m", "debug.fail_at_step=1,null", "train.max_steps=2", *QUICK[1:],
                   f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = read_summary(tmp_path / "0")
    assert failed["status"] == "failed"
    assert "injected failure" in failed["error"]["message"]
    assert failed["memory"]["host_peak_rss_mib"] > 50  # the job's peak before it died
    assert (tmp_path / "0" / "metrics.jsonl").is_file()  # step 1 was logged before the failure
    assert read_summary(tmp_path / "1")["status"] == "ok"  # the job after it ran

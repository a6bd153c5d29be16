"""The CPU twin of the SDXL stage x resolution x batch sweep, through the real CLI."""

from __future__ import annotations

import csv

import pytest

from tests.helpers.cli import read_summary, run_cli


@pytest.mark.slow
def test_cpu_twin_sweep_survives_a_failing_job_and_reports(tmp_path):
    # batch 0 is refused at validation: one job forced to fail among eight that train.
    proc = run_cli("-m", "experiment=stage_resolution_batch_cpu", "train.batch_size=2,8,0",
                   f"hydra.sweep.dir={tmp_path}", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted((p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    assert len(jobs) == 12
    statuses = {}
    for job in jobs:
        s = read_summary(job)
        statuses[(s["choices"]["zero_stage"], s["choices"]["resolution"], s["choices"]["batch_size"])] = s["status"]
    assert sum(v == "ok" for v in statuses.values()) == 8
    assert all(statuses[(stage, res, 0)] == "failed" for stage in (1, 3) for res in (16, 32))
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12
    assert sum(r["status"] == "failed" for r in rows) == 4
    assert (tmp_path / "summary.md").read_text().count("failed") >= 4


@pytest.mark.slow
def test_parallel_joblib_launcher(tmp_path):
    """hydra/launcher=joblib runs jobs side by side; each still trains in its own worker processes."""
    proc = run_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "zero_stage=1,2", "data=synthetic",
                   "resolution=16", "train.max_steps=3", "train.batch_size=2", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = sorted(read_summary(tmp_path / job)["choices"]["zero_stage"] for job in ("0", "1"))
    assert stages == [1, 2]
    assert all(read_summary(tmp_path / job)["status"] == "ok" for job in ("0", "1"))
    assert (tmp_path / "summary.csv").is_file()

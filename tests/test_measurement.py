"""The figures a run reports are the ones it had: a known allocation shows in the host peak."""

from __future__ import annotations

import time

import pytest

from tests.helpers.cli import read_summary, run_cli

QUICK = ["train.max_steps=3", "train.batch_size=8", "evaluate.enabled=false", "zero_stage=0", "scheduler=constant"]
BALLAST_MIB = 600
# Peak RSS differs between identical runs by allocator timing (tens of MiB); 15% of the ballast covers it.
TOLERANCE = 0.15


@pytest.mark.slow
def test_known_host_allocation_shows_in_the_peak(tmp_path):
    peaks = {}
    for name, extra in (("base", []), ("ballast", [f"debug.host_alloc_mib={BALLAST_MIB}"])):
        started = time.time()
        proc = run_cli(*QUICK, *extra, f"hydra.run.dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = read_summary(tmp_path / name)
        check_startup(summary, started, time.time())
        memory = summary["memory"]
        assert memory["gpu_peak_process_mib"] is None and memory["gpu_peak_allocated_mib"] is None  # no GPU
        assert 100 < memory["host_peak_rss_mib"] < 16 * 1024
        # The worker's own peak: the job-wide figure also holds start-up's short-lived children (DeepSpeed
        # compiles a libaio probe with gcc at import), which can out-peak training itself on a tiny model.
        rank0 = memory["per_rank"][0]["host_peak_rss_mib"]
        assert rank0 <= memory["host_peak_rss_mib"] + 1
        peaks[name] = rank0
    assert peaks["ballast"] - peaks["base"] == pytest.approx(BALLAST_MIB, rel=TOLERANCE), peaks


def check_startup(summary: dict, started: float, ended: float) -> None:
    """summary.json's start-up phases add up to the time from the command's start to its first step."""
    startup = summary["startup"]
    parent, checks, worker = startup["parent"], startup["checks"], startup["worker"]
    assert list(parent) == ["compose_and_imports", "launch_checks", "launcher_imports"]
    assert list(checks) == ["checks", "plan", "ops_build"]  # beside the workers' imports, not before them
    assert list(worker) == ["start_and_imports_s", "waiting_for_checks_s", "setup_s", "first_step_s"]
    assert all(v >= 0 for v in [*parent.values(), *checks.values(), *worker.values()])
    assert startup["to_first_step_s"] == pytest.approx(sum(parent.values()) + sum(worker.values()), abs=0.01)
    assert startup["ops_build_s"] == checks["ops_build"]
    assert startup["to_first_step_without_ops_build_s"] <= startup["to_first_step_s"]
    first_step_end = summary["perf"]["first_step_end_unix"]
    assert started - 0.5 < first_step_end < ended  # on the caller's clock, within the command's life
    # The whole command's start (this test's clock) to the first step, vs the job's own account of it.
    assert startup["to_first_step_s"] == pytest.approx(first_step_end - started, abs=1.0)

"""The CPU-Adam time probe (plan/cpu_optimizer.py): its size is past the last-level cache, and its figure is
measured once per host and thread count, whatever memory is free when a job starts. Nothing here times anything: the timing itself is benchmarks/bench_cpu_adam.py's
(experiments/results/planner.md, "The CPU optimizer's time floor")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import OFFLOAD_RUN_ARGS
from tests.helpers.cli import read_summary, run_cli
from zerotune.plan import cpu_optimizer

MIB, GIB = 2**20, 2**30


def test_the_probe_is_sized_past_the_last_level_cache():
    assert cpu_optimizer.probe_params(llc_bytes=32 * MIB, avail_bytes=64 * GIB) == 64 * MIB  # 8 × 32 MiB / 4 B
    assert cpu_optimizer.probe_params(llc_bytes=1 * MIB, avail_bytes=64 * GIB) == 50_000_000  # the floor
    # a small host: at most 1/8 of its available memory, at 16 B per parameter
    assert cpu_optimizer.probe_params(llc_bytes=32 * MIB, avail_bytes=4 * GIB) == 4 * GIB // 8 // 16


def test_this_hosts_probe_is_past_its_cache():
    llc = cpu_optimizer.last_level_cache_bytes()
    if llc is None:
        pytest.skip("sysfs does not give this host's cache sizes")
    available = cpu_optimizer.available_bytes()
    if available is not None and available // 8 < 8 * llc * 4:
        pytest.skip("too little memory available for a probe of 8× the cache")
    assert cpu_optimizer.probe_params() * 4 >= 8 * llc


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path):
    for index, size in enumerate(["32K", "32K", "512K", "32768K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert cpu_optimizer.last_level_cache_bytes(tmp_path) == 32 * MIB
    assert cpu_optimizer.last_level_cache_bytes(tmp_path / "absent") is None


def figure() -> float | None:
    found = cpu_optimizer.cpu_adam_figure()
    return found.s_per_param if found else None


def _timer(monkeypatch, timed: list[int], figure: float = 7e-10) -> None:
    monkeypatch.setattr(cpu_optimizer, "op_built", lambda: True)
    monkeypatch.setattr(cpu_optimizer, "time_step", lambda n, repeats=5: timed.append(n) or figure)


def test_a_plan_does_not_build_cpu_adam_and_says_how_to(tmp_path: Path, monkeypatch):
    """Building the op takes minutes; a plan is a first answer. Unbuilt, the floor is unmeasured and the note
    says how to build it; a figure timed earlier on this host is still read."""
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # an empty cache: nothing built
    monkeypatch.setattr(cpu_optimizer, "time_step", lambda n, repeats=5: pytest.fail("timed (and built) the op"))
    assert not cpu_optimizer.op_built() and cpu_optimizer.cpu_adam_figure() is None
    assert "python -m zerotune.host.ops" in cpu_optimizer.why_unmeasured()
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / cpu_optimizer.CACHE_FILE).write_text(
        json.dumps({cpu_optimizer.host_key(): {"s_per_param": 7e-10, "params": 10**12}}))
    assert cpu_optimizer.cpu_adam_figure() == cpu_optimizer.CpuAdamFigure(7e-10, 10**12, timed_now=False)


def test_the_figure_is_measured_once_per_host_whatever_memory_is_free(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_optimizer, "last_level_cache_bytes", lambda: 32 * MIB)
    free = {"bytes": 64 * GIB}
    monkeypatch.setattr(cpu_optimizer, "available_bytes", lambda: free["bytes"])
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    # The older files (v1's 4M figures, v2's keyed by probe size) are not read: the op is timed anew.
    (plan_dir / "cpu_adam.json").write_text(json.dumps({cpu_optimizer.host_key(): 1e-10}))
    (plan_dir / "cpu_adam_v2.json").write_text(json.dumps({f"{cpu_optimizer.host_key()}|{64 * MIB}params": 1e-10}))
    timed: list[int] = []
    _timer(monkeypatch, timed)
    first = cpu_optimizer.cpu_adam_figure()
    assert first is not None and first.timed_now and timed == [64 * MIB]
    stored = json.loads((plan_dir / cpu_optimizer.CACHE_FILE).read_text())
    assert stored == {cpu_optimizer.host_key(): {"s_per_param": 7e-10, "params": 64 * MIB}}
    # Later jobs read it back, whatever is free then (the memory cap would size a probe differently each time).
    for available in (20 * GIB, 3 * GIB, 64 * GIB):
        free["bytes"] = available
        again = cpu_optimizer.cpu_adam_figure()
        assert again == cpu_optimizer.CpuAdamFigure(7e-10, 64 * MIB, timed_now=False)
    assert timed == [64 * MIB]


def test_a_probe_capped_by_memory_is_timed_again_once_a_bigger_one_fits(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_optimizer, "last_level_cache_bytes", lambda: 32 * MIB)
    free = {"bytes": 4 * GIB}  # caps the probe at 1/8 of it: 32M parameters, below the full 64M
    monkeypatch.setattr(cpu_optimizer, "available_bytes", lambda: free["bytes"])
    timed: list[int] = []
    _timer(monkeypatch, timed, 9e-10)
    capped = 4 * GIB // 8 // 16
    assert figure() == 9e-10 and timed == [capped]
    assert figure() == 9e-10 and timed == [capped]  # still capped: reused
    free["bytes"] = 6 * GIB  # a bigger capped probe would fit, but not the whole one: reused still
    assert figure() == 9e-10 and timed == [capped]
    free["bytes"] = 64 * GIB
    _timer(monkeypatch, timed, 7e-10)
    assert figure() == 7e-10 and timed == [capped, 64 * MIB]
    assert figure() == 7e-10 and timed == [capped, 64 * MIB]


def test_the_key_is_the_host_and_its_thread_count(monkeypatch):
    monkeypatch.setattr(cpu_optimizer.torch, "get_num_threads", lambda: 2)
    two = cpu_optimizer.host_key()
    monkeypatch.setattr(cpu_optimizer.torch, "get_num_threads", lambda: 16)
    assert two.endswith("|2threads") and cpu_optimizer.host_key().endswith("|16threads")
    assert "params" not in two


def test_an_unmeasurable_floor_is_none_and_not_cached(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_optimizer, "time_step", lambda n, repeats=5: None)
    assert cpu_optimizer.cpu_adam_figure() is None
    assert not (tmp_path / "plan" / cpu_optimizer.CACHE_FILE).exists()


def cpu_adam_term(run_dir: Path) -> dict:
    terms = read_summary(run_dir)["plan"]["time_terms"]
    return next(t for t in terms if t["term"] == "cpu_optimizer")


def test_a_second_offload_job_runs_no_probe(offload_run, tmp_path: Path):
    """Two `offload=cpu` jobs in a row on one host: the first timed CPU-Adam or found it timed, the second reads
    the figure (its plan says so), whatever memory is free when it starts."""
    first_dir, _ = offload_run
    first = cpu_adam_term(first_dir)
    assert first["seconds"] is not None, first
    second_dir = tmp_path / "second"
    proc = run_cli(*OFFLOAD_RUN_ARGS, "train.max_steps=1", "checkpoint.final=false", "checkpoint.every_n_steps=0",
                   f"hydra.run.dir={second_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = cpu_adam_term(second_dir)
    assert "no probe ran" in second["note"], second
    assert second["seconds"] == first["seconds"]  # the same per-parameter figure over the same partition
    assert read_summary(second_dir)["startup"]["checks"]["plan"] is not None

"""The CPU-Adam time probe (plan/cpu_optimizer.py): its size is past the last-level cache, and its cached
figure is keyed by that size. Nothing here times anything: the timing itself is benchmarks/bench_cpu_adam.py's
(experiments/results/planner.md, "The CPU optimizer's time floor")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_the_cached_figure_is_keyed_by_the_probe_size(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    params = cpu_optimizer.probe_params()
    key = cpu_optimizer.host_key(params)
    assert key.endswith(f"|{params}params")
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    # The old probe's file and a figure for another size are not reused: the op is timed anew.
    (plan_dir / "cpu_adam.json").write_text(json.dumps({key.rsplit("|", 1)[0]: 1e-10}))
    (plan_dir / cpu_optimizer.CACHE_FILE).write_text(json.dumps({cpu_optimizer.host_key(4_000_000): 1e-10}))
    timed = []
    monkeypatch.setattr(cpu_optimizer, "time_step", lambda n, repeats=5: timed.append(n) or 7e-10)
    assert cpu_optimizer.seconds_per_param() == 7e-10 and timed == [params]
    stored = json.loads((plan_dir / cpu_optimizer.CACHE_FILE).read_text())
    assert stored[key] == 7e-10 and stored[cpu_optimizer.host_key(4_000_000)] == 1e-10
    # Then the figure for this size is read back, not timed again.
    assert cpu_optimizer.seconds_per_param() == 7e-10 and timed == [params]


def test_an_unmeasurable_floor_is_none_and_not_cached(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_optimizer, "time_step", lambda n, repeats=5: None)
    assert cpu_optimizer.seconds_per_param() is None
    assert not (tmp_path / "plan" / cpu_optimizer.CACHE_FILE).exists()

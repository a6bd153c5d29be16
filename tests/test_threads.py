"""launch.threads: each worker's torch intra-op threads, from the cores it may use and its node's workers."""

from __future__ import annotations

import os

import pytest

from tests.helpers.cli import compose_cfg, run_cli
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.train.distributed import apply_threads, available_cores, choose_threads


@pytest.mark.parametrize(("cores", "workers", "expected"), [(2, 1, 2), (2, 2, 1), (16, 3, 5), (1, 4, 1)])
def test_auto_shares_the_cores_among_the_nodes_workers(cores, workers, expected):
    threads, rule = choose_threads("auto", cores, workers, omp_env=None)
    assert threads == expected and f"{cores} cores / {workers} workers" in rule


def test_auto_keeps_omp_num_threads_and_an_explicit_count_wins():
    assert choose_threads("auto", 16, 2, omp_env="3") == (3, "OMP_NUM_THREADS")
    assert choose_threads("auto", 16, 2, omp_env="") == (8, "16 cores / 2 workers on this node")
    assert choose_threads(4, 2, 2, omp_env="1") == (4, "launch.threads")
    assert choose_threads("6", 2, 1, omp_env=None) == (6, "launch.threads")


@pytest.mark.parametrize("bad", [0, -1, "abc", 1.5, True, "2x"])
def test_a_bad_thread_count_names_the_key(bad):
    with pytest.raises(ConfigError) as err:
        choose_threads(bad, 2, 1, omp_env=None)
    assert err.value.key == "launch.threads" and "launch.threads=auto" in err.value.fix


def test_apply_sets_torchs_threads(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        record = apply_threads(compose_cfg().launch)
        assert record["intra_op"] == torch.get_num_threads() == max(1, available_cores() // 2)
        record = apply_threads(compose_cfg("launch.threads=1").launch)
        assert record == {"intra_op": 1, "rule": "launch.threads"} and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cli_refuses_a_bad_thread_count_before_any_worker(tmp_path):
    proc = run_cli("launch.threads=0", "train.max_steps=2", f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr[-2000:]
    assert "config error at `launch.threads`" in proc.stderr and not (tmp_path / "logs").exists()


def test_affinity_is_what_auto_counts():
    if hasattr(os, "sched_getaffinity"):
        assert available_cores() == len(os.sched_getaffinity(0))

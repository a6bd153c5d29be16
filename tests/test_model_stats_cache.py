"""model_stats is cached per architecture, so that a job's parent counts parameters without importing diffusers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import compose_cfg, config_of
from zerotune import models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_a_cached_count_equals_a_measured_one(cache):
    cfg = config_of("adapter=lora")
    measured = models.model_stats(cfg.model, cfg.adapter)
    (entry,) = cache.glob("stats-*.json")
    assert models.model_stats(cfg.model, cfg.adapter) == measured
    assert models._measure_stats(cfg.model, cfg.adapter) == measured
    assert json.loads(entry.read_text())["num_params"] == measured.num_params
    assert measured.num_trainable < measured.num_params  # the adapter's count, not the full model's


def test_each_architecture_and_adapter_has_its_own_entry(cache):
    full, lora, wider = (config_of(*o) for o in ((), ("adapter=lora",), ("model=sdxl_tiny",)))
    counts = {models.model_stats(c.model, c.adapter) for c in (full, lora, wider)}
    assert len(counts) == 3 and len(list(cache.glob("stats-*.json"))) == 3


def test_a_damaged_entry_is_measured_again(cache):
    cfg = compose_cfg()
    measured = models.model_stats(cfg.model, cfg.adapter)
    (entry,) = cache.glob("stats-*.json")
    for damage in ('{"num_params": 1', '{"num_params": 1}', "[]"):
        entry.write_text(damage)
        assert models.model_stats(cfg.model, cfg.adapter) == measured
        assert json.loads(entry.read_text())["num_params"] == measured.num_params


def test_the_job_parent_checks_and_plans_without_diffusers(cache, tmp_path):
    """With the count cached (any earlier job, or `python -m zerotune plan`), the parent's checks and plan import
    neither diffusers nor peft: 2 s and 300 MiB a job start used to pay just to count parameters."""
    from tests.helpers.cli import preflight
    from zerotune.plan import guard

    cfg = compose_cfg("adapter=lora")
    guard.job_plan(checked := preflight(cfg), guard.job_gpu(cfg))  # counts and traces, cached
    assert checked.model_stats.num_trainable < checked.model_stats.num_params
    code = """
import sys
from tests.helpers.cli import compose_cfg
from zerotune.plan import guard as planning
from tests.helpers.cli import preflight
cfg = compose_cfg("adapter=lora")
checked = preflight(cfg)
planning.job_plan(checked, planning.job_gpu(cfg))
print(sorted(m for m in ("diffusers", "peft", "transformers", "sklearn", "matplotlib") if m in sys.modules))
"""
    env = {**__import__("os").environ, "ZEROTUNE_CACHE_DIR": str(cache.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"

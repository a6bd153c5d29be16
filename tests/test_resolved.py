"""A run is resolved once, into one frozen, typed object: the composed config is never changed, the resolved
one cannot be, and a job's workers read what its parent resolved instead of resolving again."""

from __future__ import annotations

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import compose_cfg, preflight
from zerotune.config import schema
from zerotune.config.compose.settle import to_config
from zerotune.plan.resolve import RESOLVED_FILE, ResolvedRun
from zerotune.rundir import CONFIG, RunDir


def _ds_file(tmp_path) -> str:
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2,
                                "train_micro_batch_size_per_gpu": "auto"}))
    return str(file)


def test_preflight_leaves_the_composed_config_as_it_was_and_freezes_its_own(tmp_path):
    cfg = compose_cfg(f"deepspeed.config_file={_ds_file(tmp_path)}", "train.max_steps=3")
    before = OmegaConf.to_container(cfg, resolve=True)
    run = preflight(cfg)
    assert OmegaConf.to_container(cfg, resolve=True) == before  # nothing was folded into Hydra's config
    assert isinstance(run.config, schema.Config)
    assert (run.config.zero_stage.stage, run.config.train.grad_accum) == (1, 2)  # the file's values
    assert run.config.scheduler.warmup_steps < 3  # a default warm-up fitted to a 3-step run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.config.train.grad_accum = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.use_deepspeed = False  # type: ignore[misc]


def test_the_resolved_run_survives_its_file(tmp_path):
    run = preflight(compose_cfg("zero_stage=3", "offload=cpu", "adapter=lora"), run_dir=tmp_path)
    run.save(tmp_path)
    again = ResolvedRun.load(tmp_path)
    assert again == run
    assert again.zero_stage == 3 and again.config.adapter.name == "lora"


def test_config_yaml_is_written_once_per_run(tmp_path):
    run_dir = RunDir(tmp_path)
    config = to_config(compose_cfg())
    run_dir.write_config(config)
    with pytest.raises(RuntimeError, match="written once"):
        run_dir.write_config(config)
    run_dir.archive_previous_attempt()  # a rerun into the folder: the earlier run's records move aside first
    run_dir.write_config(config)
    assert (tmp_path / "attempts" / "1" / CONFIG).is_file()


def test_a_job_trains_what_its_parent_resolved(llamafactory_offload_run):
    """The workers read resolved.json: the user's file (LLaMA-Factory's ZeRO-3 offload file, tests/conftest.py)
    is folded in once, by the job's parent, and its warnings are said once (a worker that resolved again would say
    them again)."""
    out, proc = llamafactory_offload_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads((out / RESOLVED_FILE).read_text())
    # the file's stage and offload, not the command line's defaults (zero_stage=2 offload=none)
    assert resolved["config"]["zero_stage"]["stage"] == 3 and resolved["config"]["offload"]["device"] == "cpu"
    assert OmegaConf.load(out / CONFIG).zero_stage.stage == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["choices"]["zero_stage"] == 3
    assert summary["config_warnings"]
    for warning in summary["config_warnings"]:  # e.g. "comms_config" is not a DeepSpeed key
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.endswith(warning)]
        assert len(said) == 1, said

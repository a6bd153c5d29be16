"""A run is resolved once, into one frozen, typed object: the composed config is never changed, the resolved
one cannot be, and a job's workers read what its parent resolved instead of resolving again."""

from __future__ import annotations

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import compose_cfg, run_cli
from zerotune import schema
from zerotune.preflight import preflight
from zerotune.resolved import RESOLVED_FILE, ResolvedRun
from zerotune.rundir import CONFIG, RunDir

QUICK = ["train.max_steps=2", "train.log_every=1", "evaluate.enabled=false"]


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
    config = schema.to_config(compose_cfg())
    run_dir.write_config(config)
    with pytest.raises(RuntimeError, match="written once"):
        run_dir.write_config(config)
    run_dir.archive_previous_attempt()  # a rerun into the folder: the earlier run's records move aside first
    run_dir.write_config(config)
    assert (tmp_path / "attempts" / "1" / CONFIG).is_file()


def test_a_job_trains_what_its_parent_resolved(tmp_path):
    """The workers read resolved.json: the user's file is folded in once, by the job's parent, and its warnings
    are said once (a worker that resolved again would say them again)."""
    ds = json.loads(open(_ds_file(tmp_path)).read())
    ds["fp32_allreduce"] = True  # an older spelling: translated, with a warning
    file = tmp_path / "ds_warn.json"
    file.write_text(json.dumps(ds))
    out = tmp_path / "run"
    proc = run_cli(f"deepspeed.config_file={file}", *QUICK, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads((out / RESOLVED_FILE).read_text())
    assert resolved["config"]["zero_stage"]["stage"] == 1 and resolved["config"]["train"]["grad_accum"] == 2
    assert OmegaConf.load(out / CONFIG).train.grad_accum == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["choices"]["zero_stage"] == 1
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "fp32_allreduce" in line]
    assert len(said) == 1, said

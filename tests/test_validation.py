"""Every bad configuration stops before any model is built, naming the key and the fix."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.cli import call_main, compose_cfg, preflight, read_summary, run_cli
from tests.helpers.fixes import check_fix
from zerotune.cli.ds_config import main as ds_config_main
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.host.platform import Platform, detect


def plan_error(*overrides: str, platform: Platform | None = None) -> ConfigError:
    """The error preflight stops with; its fix line is applied, and must pass (tests/helpers/fixes.py)."""
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*overrides), platform=platform, overrides=list(overrides))
    check_fix(err.value, list(overrides),
              lambda fixed: preflight(compose_cfg(*fixed), platform=platform, overrides=fixed))
    return err.value


def write_json(tmp_path, data, name="ds.json"):
    file = tmp_path / name
    file.write_text(data if isinstance(data, str) else json.dumps(data))
    return file


def test_stage_out_of_range():
    err = plan_error("zero_stage.stage=5")
    assert err.key == "zero_optimization.stage" and "0, 1, 2 or 3" in err.problem and "zero_stage.stage=3" in err.fix


def test_param_offload_below_stage_3():
    err = plan_error("zero_stage=2", "offload=cpu", "offload.params=true")
    assert err.key == "zero_optimization.offload_param" and "stage 3" in err.problem
    assert "zero_stage=3" in err.fix


def test_offload_at_stage_0():
    err = plan_error("zero_stage=0", "offload=cpu")
    assert err.key == "zero_optimization.offload_optimizer" and "zero_stage=2" in err.fix


def test_nvme_below_stage_3_would_silently_use_host_memory(tmp_path):
    err = plan_error("zero_stage=2", "offload=nvme", f"offload.path={tmp_path}")
    assert err.key == "offload" and "never writes the NVMe folder" in err.problem


def test_nvme_without_path():
    err = plan_error("zero_stage=3", "offload=nvme")
    assert "offload.path" in err.key and "offload.path=" in err.fix


def test_nvme_missing_path(tmp_path):
    err = plan_error("zero_stage=3", "offload=nvme", f"offload.path={tmp_path}/no/such/dir")
    assert "offload.path" in err.key and "does not exist" in err.problem


def test_nvme_unwritable_path(tmp_path):
    # /proc refuses new files even for root, unlike a chmod'ed folder.
    err = plan_error("zero_stage=3", "offload=nvme", "offload.path=/proc/zerotune-swap")
    assert "offload.path" in err.key and "/proc/zerotune-swap cannot be created in /proc" in err.problem


def test_nvme_path_that_is_a_file(tmp_path):
    file = tmp_path / "f"
    file.write_text("x")
    err = plan_error("zero_stage=3", "offload=nvme", f"offload.path={file}")
    assert "not a folder" in err.problem


def test_inconsistent_batch_sizes_in_hand_written_json(tmp_path):
    file = write_json(tmp_path, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                 "gradient_accumulation_steps": 3})
    err = plan_error(f"deepspeed.config_file={file}")
    assert err.key == "train_batch_size"
    assert "8 (ds.json) != micro batch 2 (ds.json) x gradient accumulation 3 (ds.json)" in err.problem
    # the fix keeps the global batch the file asked for: 8 = 2 x 4
    assert err.fix == "set gradient_accumulation_steps to 4 in ds.json (keeps train_batch_size 8)"


def test_bf16_and_fp16_both_enabled(tmp_path):
    file = write_json(tmp_path, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    err = plan_error(f"deepspeed.config_file={file}")
    assert err.key == "bf16.enabled" and "both enabled" in err.problem and "ds.json" in err.problem


@pytest.mark.parametrize("override", ["train.grad_clip=-1"])
def test_negative_clip(override):
    err = plan_error(override)
    assert err.key == "train.grad_clip" and ">= 0" in err.problem


def test_negative_clip_in_json(tmp_path):
    file = write_json(tmp_path, {"gradient_clipping": -0.5})
    err = plan_error(f"deepspeed.config_file={file}")
    assert err.key == "gradient_clipping" and ">= 0" in err.problem and err.fix == "change gradient_clipping in ds.json"


@pytest.mark.parametrize("key", ["train.batch_size", "train.grad_accum", "train.max_steps"])
def test_zero_counts(key):
    err = plan_error(f"{key}=0")
    assert err.key == key and "positive integer" in err.problem


def test_unknown_optimizer_lists_supported():
    err = plan_error("optimizer.name=sgdx")
    assert err.key == "optimizer.name" and "adamw" in err.fix and "lion" in err.fix


def test_optimizer_not_config_driven():
    err = plan_error("optimizer.name=OneBitAdam")
    assert "not available" in err.problem and "adamw" in err.fix


@pytest.mark.skipif(detect().device_type != "cpu", reason="checks the CPU accelerator's missing kernels")
def test_optimizer_unsupported_on_this_device():
    err = plan_error("optimizer=lamb")
    assert err.key == "optimizer.type" and "FusedLamb" in err.problem
    err = plan_error("optimizer=lion")
    assert "offload=cpu" in err.fix
    preflight(compose_cfg("optimizer=lion", "offload=cpu"))  # CPU Lion exists


@pytest.mark.skipif(importlib.util.find_spec("mup") is not None, reason="mup is installed here")
def test_mup_optimizers_need_mup():
    err = plan_error("optimizer=muadamw")
    assert err.key == "optimizer.type" and err.fix == "pip install mup"


@pytest.mark.parametrize(("overrides", "fix"), [
    (("resolution.size=101",), "resolution.size=100 or 102"),
    (("model=sdxl", "data=synthetic", "resolution.size=1000"), "resolution.size=992 or 1024"),
    (("resolution.size=0",), "resolution=1024"),
])
def test_bad_resolution(overrides, fix):
    err = plan_error(*overrides)
    assert err.key == "resolution.size" and fix in err.fix


def test_precision_the_device_cannot_do():
    no_half = Platform("cpu", True, "", bf16=False, fp16=False)
    err = plan_error("precision=bf16", platform=no_half)
    assert err.key == "bf16.enabled" and "cannot train in bf16" in err.problem and "precision=fp32" in err.fix
    err = plan_error("precision=fp16", platform=no_half)
    assert err.key == "fp16.enabled"


@pytest.mark.parametrize("platform", [
    Platform("mps", False, "DeepSpeed does not support macOS/MPS", bf16=False, fp16=True),
    Platform("cuda", False, "DeepSpeed is not supported on ROCm", bf16=True, fp16=True),
])
def test_deepspeed_unavailable_platform(platform):
    err = plan_error("zero_stage=2", platform=platform)
    assert err.key == "zero_stage" and "needs DeepSpeed" in err.problem and "zero_stage=0" in err.fix
    checked = preflight(compose_cfg("zero_stage=0"), platform=platform)
    assert checked.use_deepspeed is False  # stage 0 still trains, with plain accelerate


def test_deepspeed_own_classes_reject_unknown_key(tmp_path):
    file = write_json(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}})
    err = plan_error(f"deepspeed.config_file={file}")
    assert err.key == "zero_optimization.reduce_bucket_sise" and "Extra inputs" in err.problem


def test_malformed_json_names_line_and_column(tmp_path):
    file = write_json(tmp_path, '{\n  "gradient_clipping": 1.0,\n  "zero_optimization": {stage: 2}\n}')
    err = plan_error(f"deepspeed.config_file={file}")
    assert err.key == "deepspeed.config_file" and "line 3, column 25" in err.problem


def test_missing_json_file(tmp_path):
    err = plan_error(f"deepspeed.config_file={tmp_path}/nope.json")
    assert "does not exist" in err.problem


def test_cli_config_error_exits_nonzero_and_keeps_files(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    proc = run_cli("zero_stage=2", "offload=cpu", "offload.params=true", f"hydra.run.dir={run_dir}", timeout=180)
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert "zero_optimization.offload_param" in proc.stderr and "fix: zero_stage=3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (run_dir / "notes.txt").read_text() == "mine"
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["error"]["key"] == "zero_optimization.offload_param"
    assert not (run_dir / "metrics.jsonl").exists()  # failed before training


def test_cli_unknown_group_choice_exits_nonzero():
    proc = run_cli("zero_stage=5", timeout=60)
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert "`zero_stage`" in proc.stderr and "choose one of: 0, 1, 2, 3" in proc.stderr


def test_ds_config_cli_error_exits_nonzero():
    proc = call_main(ds_config_main, "train.batch_size=0")  # its process: tests/test_ds_config.py
    assert proc.returncode == CONFIG_ERROR_EXIT and "train.batch_size" in proc.stderr


def test_decay_schedulers_need_warmup_steps():
    err = plan_error("scheduler=cosine", "scheduler.warmup_steps=0")
    assert err.key == "scheduler.warmup_steps" and ">= 1" in err.problem


def test_typed_warmup_longer_than_training():
    err = plan_error("scheduler=cosine", "scheduler.warmup_steps=100", "train.max_steps=50")
    assert err.key == "scheduler.warmup_steps" and err.fix == "scheduler.warmup_steps=5"


@pytest.mark.parametrize(("steps", "warmup", "kind"), [(3, 1, "WarmupCosineLR"), (50, 5, "WarmupCosineLR"),
                                                        (1, None, None)])
def test_default_warmup_is_fitted_to_a_short_run(steps, warmup, kind):
    # `python train.py train.max_steps=3` must work: the recipe's 100 warm-up steps are a default, not a choice
    overrides = ["scheduler=cosine", f"train.max_steps={steps}"]
    ds = preflight(compose_cfg(*overrides), overrides=overrides).ds_config
    assert ds.get("scheduler", {}).get("type") == kind
    if warmup is not None:
        assert ds["scheduler"]["params"]["warmup_num_steps"] == warmup


@pytest.mark.parametrize(("override", "key", "fix"), [
    ("train.batch_size=abc", "train.batch_size", "train.batch_size=<int>"),
    ("launch.num_processes=abc", "launch.num_processes", "launch.num_processes=<int>"),
    ("train.batchsize=4", "train.batchsize", "train.batch_size=4"),
    ("+train.batchsize=4", "train.batchsize", "train.batch_size=4"),
    ("zero_stag=2", "zero_stag", "zero_stage=2"),
])
def test_typed_schema_stops_bad_keys_and_types_at_composition(override, key, fix, tmp_path):
    """The schema (src/zerotune/config/schema.py) refuses these before Hydra runs: one message, exit 2, no run dir."""
    proc = run_cli(override, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert f"config error at `{key}`" in proc.stderr and f"fix: {fix}" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("config error") == 1
    assert not (tmp_path / "run").exists()


def test_a_bad_value_in_one_job_of_a_sweep_stops_the_sweep_before_it_starts(tmp_path):
    proc = run_cli("-m", "train.batch_size=8,abc", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=120)
    assert proc.returncode == CONFIG_ERROR_EXIT and "`train.batch_size`" in proc.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("world", ["0", "-2"])
def test_ds_config_cli_refuses_a_world_size_below_one(world):
    proc = call_main(ds_config_main, "--world-size", world)
    assert proc.returncode == CONFIG_ERROR_EXIT and "`--world-size`" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bucket_size_that_is_no_number_is_named_on_the_command_line():
    err = plan_error("zero_stage=2", "deepspeed.reduce_bucket_size=abc")  # its fix is applied there too
    assert err.key == "deepspeed.reduce_bucket_size" and "whole number of elements" in err.problem


def test_a_bucket_size_that_is_no_number_is_named_in_the_file(tmp_path):
    file = write_json(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": "abc"}})
    err = plan_error(f"deepspeed.config_file={file}")
    assert err.key == "zero_optimization.reduce_bucket_size" and "(ds.json)" in err.problem
    assert err.fix.startswith("set zero_optimization.reduce_bucket_size to auto in ds.json")
    file.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))  # the fix
    preflight(compose_cfg(f"deepspeed.config_file={file}"), overrides=[f"deepspeed.config_file={file}"])

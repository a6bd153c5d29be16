"""The DeepSpeed dict for every stage x offload x precision this device supports, and its contents."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import compose_cfg, config_of, preflight, run_cli
from zerotune.host.platform import detect
from zerotune.models import ModelStats
from zerotune.plan.deepspeed import DEFAULT_PARAM_BUFFER, build, param_buffer_size, validate
from zerotune.plan.resolve import merge

PLATFORM = detect()
PRECISIONS = [p for p in ("fp32", "bf16", "fp16") if PLATFORM.supports(p)]
VALID = [(s, o) for s in range(4) for o in ("none", "cpu", "nvme")
         if not (s == 0 and o != "none") and not (o == "nvme" and s < 3)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("stage", "offload"), VALID)
def test_dict_for_every_supported_combination(stage, offload, precision, tmp_path):
    cfg = compose_cfg(f"zero_stage={stage}", f"offload={offload}", f"precision={precision}",
                      f"offload.path={tmp_path}", "train.batch_size=4", "train.grad_accum=3")
    ds = preflight(cfg, world_size=2).ds_config
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 2
    # Numbers, never "auto": a U-Net has no hidden_size for accelerate to fill them from.
    assert "auto" not in json.dumps(ds)
    assert ds.get("bf16", {}).get("enabled", False) == (precision == "bf16")
    assert ds.get("fp16", {}).get("enabled", False) == (precision == "fp16")
    if offload == "none":
        assert "offload_optimizer" not in zero and "offload_param" not in zero
        assert ds["optimizer"]["params"].get("torch_adam") is True
    else:
        assert zero["offload_optimizer"]["device"] == offload
        assert ("offload_param" in zero) == (stage == 3)
        assert "torch_adam" not in ds["optimizer"]["params"]  # CPU Adam steps offloaded states
    if offload == "nvme":
        assert zero["offload_param"]["nvme_path"] == str(tmp_path)
        assert zero["offload_optimizer"]["nvme_path"] == str(tmp_path)
        assert zero["offload_param"]["buffer_size"] >= DEFAULT_PARAM_BUFFER
        assert "aio" in ds
    if stage >= 1:  # DeepSpeed's 5e8 capped at the tiny U-Net's 0.6 M parameters, rounded up to 1 M
        assert zero["reduce_bucket_size"] == 1_000_000
    if stage == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True


def test_optimizer_and_scheduler_blocks():
    cfg = compose_cfg("optimizer=lion", "offload=cpu", "scheduler=cosine", "train.max_steps=1000",
                      "optimizer.lr=3e-5")
    ds = preflight(cfg).ds_config
    assert ds["optimizer"] == {"type": "Lion", "params": {"lr": 3e-5, "betas": [0.9, 0.99], "weight_decay": 0.1}}
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ds["scheduler"]["params"]["total_num_steps"] == 1000
    assert "scheduler" not in preflight(compose_cfg("scheduler=constant")).ds_config
    onecycle = preflight(compose_cfg("scheduler=onecycle", "train.max_steps=100", "optimizer.lr=1e-4")).ds_config[
        "scheduler"]
    assert onecycle["params"]["cycle_max_lr"] == 1e-4 and onecycle["params"]["cycle_first_step_size"] == 50
    decay = preflight(compose_cfg("scheduler=warmup_decay", "train.max_steps=300")).ds_config["scheduler"]
    assert decay["type"] == "WarmupDecayLR" and decay["params"]["total_num_steps"] == 300


def test_nvme_buffer_fits_largest_parameter():
    assert param_buffer_size(10) == DEFAULT_PARAM_BUFFER
    assert param_buffer_size(123_456_789) == 124_000_000
    cfg = config_of("zero_stage=3", "offload=nvme", "offload.path=/tmp")
    ds = build(cfg, 1, ModelStats(num_params=10**9, largest_param_numel=150_000_001))
    assert ds["zero_optimization"]["offload_param"]["buffer_size"] == 151_000_000


def test_hand_written_json_is_merged_and_normalised(tmp_path, caplog):
    file = tmp_path / "ds.json"
    # The reference guide's manual-JSON shape, nested under "deepspeed_config", with an alias optimizer name.
    file.write_text(json.dumps({"deepspeed_config": {
        "gradient_clipping": 0.5, "optimizer": {"type": "cpuadam", "params": {"lr": 2e-4}},
        "zero_optimization": {"reduce_bucket_size": 12345}}}))
    ds = preflight(compose_cfg(f"deepspeed.config_file={file}")).ds_config
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 2e-4
    assert ds["zero_optimization"]["reduce_bucket_size"] == 12345
    assert ds["zero_optimization"]["stage"] == 2  # untouched keys survive the merge
    assert "AdamW implementation" in caplog.text


def test_merge_takes_the_files_blocks_whole():
    generated = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "d": 1,
                 "zero_optimization": {"stage": 2, "reduce_bucket_size": 5, "offload_optimizer": {"device": "cpu",
                                                                                                  "pin_memory": True}}}
    user = {"optimizer": {"type": "Adam", "params": {"lr": 3e-5}}, "e": 4,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert merge(generated, user) == {
        "optimizer": {"type": "Adam", "params": {"lr": 3e-5}}, "d": 1, "e": 4,
        # the user's offload replaces ours whole (no offload_optimizer of ours survives); other keys fill in
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5, "offload_param": {"device": "cpu"}}}


def test_validate_returns_copy():
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 1}, "optimizer": {"type": "ADAMW", "params": {"lr": 1e-3}}}
    out = validate(ds, PLATFORM)
    assert out["optimizer"]["type"] == "AdamW" and ds["optimizer"]["type"] == "ADAMW"
    assert out["train_batch_size"] == 2


def test_ds_config_cli_prints_validated_json(tmp_path):
    proc = run_cli("ds-config", "zero_stage=3", "offload=nvme", f"offload.path={tmp_path}", module="zerotune",
                   timeout=180)
    assert proc.returncode == 0, proc.stderr
    ds = json.loads(proc.stdout)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "nvme"


def test_auto_buckets_are_capped_at_model_size():
    small = ModelStats(num_params=2_202_305, largest_param_numel=10)
    zero = build(config_of("zero_stage=2"), 1, small)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 3_000_000 and zero["allgather_bucket_size"] == 3_000_000
    big = ModelStats(num_params=2_567_463_684, largest_param_numel=10)
    zero = build(config_of("zero_stage=3"), 1, big)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 500_000_000 and zero["stage3_prefetch_bucket_size"] == 50_000_000
    zero = build(config_of("zero_stage=2", "deepspeed.reduce_bucket_size=12345"), 1, big)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 12345


def test_zero_warmup():
    # DeepSpeed's WarmupLR refuses 0 steps; with no warm-up the lr is constant, so no scheduler block.
    assert "scheduler" not in preflight(compose_cfg("scheduler=warmup", "scheduler.warmup_steps=0")).ds_config

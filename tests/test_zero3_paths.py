"""Every user path that meets a ZeRO-3 model built under zero.Init, end to end, in the default suite: LoRA (with
offload, EMA and the evaluation pass), its export and resume, full training with offload and EMA, its export, the
export loaded back per module, resume into another stage and into another optimizer. Tiny U-Net, a few steps each;
the runs are shared by the module's tests. A folder of the user's own images on a cold latent cache at ZeRO-3,
validated with prompts: tests/test_validation_passes.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cli import call_main, read_summary, run_cli
from tests.test_lora import check_export, losses, pretrained, train_ok  # noqa: F401  (pretrained: a fixture)
from zerotune.cli.export import main as export_main
from zerotune.rundir import checkpoints

# The evaluation pass, as small as it gets: two samples per class, two sampler steps.
EVALUATE = ["evaluate.enabled=true", "evaluate.per_class=2", "evaluate.steps=2"]
FULL = ["adapter=none", "train.batch_size=4", "train.log_every=1", "scheduler=constant", "precision=fp32"]


def run_ok(run_dir, *args) -> dict:
    proc = run_cli(*args, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    return summary


@pytest.fixture(scope="module")
def lora3(tmp_path_factory, pretrained):  # noqa: F811
    """LoRA at ZeRO-3 with CPU offload, EMA and the evaluation pass; a checkpoint at its last step."""
    run = tmp_path_factory.mktemp("lora3") / "run"
    summary = train_ok(run, f"model.pretrained={pretrained}", "zero_stage=3", "offload=cpu", "ema.enabled=true",
                       *EVALUATE, "train.max_steps=3", "checkpoint.every_n_steps=3")
    return run, summary


@pytest.fixture(scope="module")
def full3(tmp_path_factory):
    """Full training at ZeRO-3 with CPU offload, EMA and the evaluation pass; a checkpoint at its last step."""
    run = tmp_path_factory.mktemp("full3") / "run"
    summary = run_ok(run, *FULL, "zero_stage=3", "offload=cpu", "ema.enabled=true", *EVALUATE,
                     "train.max_steps=2", "checkpoint.every_n_steps=2")
    return run, summary


def test_lora_trains_at_zero3_with_offload_ema_and_evaluation(lora3):
    run, summary = lora3
    assert str(summary["choices"]["zero_stage"]) == "3" and summary["choices"]["offload"] == "cpu"
    assert summary["optimizer_class"] == "DeepSpeedCPUAdam"
    assert 0 < summary["trainable_params"] < summary["frozen_params"]
    assert summary["steps"] == 3 and summary["ema"]["updates"] == 3
    assert summary["quality"]["weights"] == "ema" and summary["quality"]["samples"] == 20
    ema = torch.load(checkpoints.find(run) / checkpoints.EMA_FILE, weights_only=True)["shadow"]
    assert ema and all(".lora_" in name for name in ema)  # the EMA averages the adapter alone, gathered whole
    assert all(t.numel() > 1 for t in ema.values())  # never a partition's 1-D placeholder


def test_lora_at_zero3_exports_an_adapter_diffusers_loads(lora3, pretrained, tmp_path):  # noqa: F811
    run, _ = lora3
    check_export(run, tmp_path / "out", pretrained)


def test_lora_at_zero3_resumes_without_offload(lora3, pretrained, tmp_path):  # noqa: F811
    """A checkpoint of DeepSpeed's CPU Adam (int steps) continued by torch's AdamW (tensor steps)."""
    run, _ = lora3
    summary = train_ok(tmp_path / "resumed", f"model.pretrained={pretrained}", "zero_stage=3", "offload=none",
                       "train.max_steps=5", f"resume={run}")
    assert summary["checkpoint"]["resumed_from"]["step"] == 3 and summary["optimizer_class"] == "AdamW"
    assert sorted(losses(tmp_path / "resumed")) == [4, 5]


def test_full_training_at_zero3_with_offload_and_ema(full3):
    run, summary = full3
    assert summary["trainable_params"] == summary["num_params"] and summary["frozen_params"] == 0
    ema = torch.load(checkpoints.find(run) / checkpoints.EMA_FILE, weights_only=True)["shadow"]
    assert sum(t.numel() for t in ema.values()) == summary["num_params"]  # whole tensors, every parameter
    assert summary["ema"]["updates"] == 2 and summary["quality"]["weights"] == "ema"


def test_full_training_at_zero3_exports_and_loads_back_per_module(full3, tmp_path):
    """The export of a ZeRO-3 checkpoint, loaded module by module into a new ZeRO-3 run: its first loss is the
    loss a plain (stage 0) run from the same export gives."""
    run, _ = full3
    out = tmp_path / "out"
    proc = call_main(export_main, str(run), str(out))  # its process: tests/test_final_checkpoint.py
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = {}
    for stage in (3, 0):
        run_ok(tmp_path / f"from{stage}", *FULL, f"zero_stage={stage}", "evaluate.enabled=false", "train.max_steps=1",
               f"model.pretrained={out / 'unet'}", "checkpoint.final=false")
        first[stage] = losses(tmp_path / f"from{stage}")[1]
    assert first[3] == pytest.approx(first[0], rel=1e-5)


@pytest.mark.parametrize(("stage", "offload", "mode"), [(0, "none", "full"), (3, "none", "universal")])
def test_zero3_checkpoint_resumes_into_another_stage_or_optimizer(full3, tmp_path, stage, offload, mode):
    run, _ = full3
    summary = run_ok(tmp_path / "resumed", *FULL, f"zero_stage={stage}", f"offload={offload}",
                     "evaluate.enabled=false", "train.max_steps=3", f"resume={run}")
    assert summary["checkpoint"]["resumed_from"]["step"] == 2
    assert summary["checkpoint"]["resumed_from"]["mode"] == mode
    assert sorted(losses(tmp_path / "resumed")) == [3]

"""The paths only a CUDA card exercises, on sdxl_tiny: bf16 and fp16 training steps, NVML telemetry, the planner's
guard against a real card's free memory, checkpoint and resume, and export. Marked `cuda`: skipped where torch sees
no GPU (tests/conftest.py); `bash benchmarks/gpu/run.sh paths` runs them on the GPU machine (`pytest -m cuda`)."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import read_losses, read_summary, run_cli

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

TINY = ["model=sdxl_tiny", "data=synthetic", "resolution=64", "train.batch_size=2", "zero_stage=2",
        "checkpoint.final=false"]


def train_ok(run_dir, *args) -> dict:
    proc = run_cli(*TINY, *args, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    return summary


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_on_the_card(tmp_path, precision):
    summary = train_ok(tmp_path, f"precision={precision}", "train.max_steps=4")
    assert summary["steps"] == 4 and summary["choices"]["precision"] == precision
    losses = read_losses(tmp_path)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert summary["env"]["gpu_count"] >= 1 and summary["env"]["cuda_version"] is not None


def test_nvml_telemetry_reads_the_process_on_the_card(tmp_path):
    memory = train_ok(tmp_path, "precision=bf16", "train.max_steps=3")["memory"]
    for key in ("gpu_peak_process_mib", "gpu_peak_device_mib", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib"):
        assert memory[key] is not None and memory[key] > 0, (key, memory)
    # nvidia-smi's figure holds the CUDA context besides torch's cache; the card's holds the process's
    assert memory["gpu_peak_process_mib"] >= memory["gpu_peak_reserved_mib"]
    assert memory["gpu_peak_device_mib"] >= memory["gpu_peak_process_mib"]
    assert memory["gpu_peak_reserved_mib"] >= memory["gpu_peak_allocated_mib"]


def test_plan_guard_refuses_a_job_over_the_cards_memory(tmp_path):
    """A batch whose activations cannot fit any card: refused (exit 2) before training, naming plan.guard."""
    proc = run_cli(*TINY, "resolution=1024", "train.batch_size=4096", "train.max_steps=1",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "plan.guard" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_plan_guard_lets_a_small_job_through_and_records_the_card(tmp_path):
    plan = train_ok(tmp_path, "precision=bf16", "train.max_steps=1", "plan.guard=refuse")["plan"]
    assert plan["gpu"] is not None and plan["fits"] is True
    assert plan["gpu_peak_mib"] > 0


def test_checkpoint_resume_and_export_on_the_card(tmp_path):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    train_ok(first, "precision=bf16", "train.max_steps=2", "checkpoint.every_n_steps=2")
    summary = train_ok(resumed, "precision=bf16", "train.max_steps=4", "checkpoint.every_n_steps=2",
                       f"resume={first / 'checkpoints' / 'step-0000002'}")
    assert summary["checkpoint"]["resumed_from"]["step"] == 2
    assert [c["step"] for c in summary["checkpoint"]["saved"]] == [4]
    assert len(read_losses(resumed)) == 2  # steps 3 and 4 only
    out = tmp_path / "export"
    proc = run_cli("export", str(resumed / "checkpoints"), str(out), module="zerotune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = load_file(str(out / "unet.safetensors"))
    assert weights and all(t.device.type == "cpu" for t in weights.values())
    assert all(bool(t.float().isfinite().all()) for t in weights.values())

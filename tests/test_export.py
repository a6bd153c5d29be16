"""Export: a ZeRO-3 checkpoint becomes a diffusers folder whose outputs equal the training model's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import ROOT, cli_env, read_summary, run_cli

# Trains 2 steps under ZeRO-3 in one process, saves a checkpoint, and records what the *training* engine
# (parameters partitioned, gathered per layer) outputs on a fixed input, and the EMA it holds.
TRAIN_AND_PROBE = textwrap.dedent("""
    import sys, torch
    from tests.helpers.cli import compose_cfg
    from zerotune.train import distributed
    distributed.ensure_single_process_env()
    from zerotune.rundir.loggers import NullLogger
    from tests.helpers.cli import preflight
    from zerotune.rundir import RunDir
    from zerotune.train.trainer import Trainer

    out = sys.argv[1]
    cfg = compose_cfg("zero_stage=3", "train.batch_size=4", "ema.enabled=true", "train.max_steps=2",
                      "scheduler=constant", "checkpoint.every_n_steps=2", f"checkpoint.dir={out}/checkpoints")
    t = Trainer(preflight(cfg, 1), RunDir(out), NullLogger())
    for _ in range(2):
        t.train_step()
    t.save_checkpoint()
    g = torch.Generator().manual_seed(1)
    x, steps, labels = torch.randn(3, 1, 8, 8, generator=g), torch.tensor([10, 500, 990]), torch.tensor([0, 3, 10])
    t.unet.eval()
    with torch.no_grad():
        y = t.unet(x, steps, encoder_hidden_states=None, class_labels=labels).sample
    torch.save({"x": x, "t": steps, "labels": labels, "y": y, "ema": t.ema.shadow}, f"{out}/probe.pt")
    t.accelerator.end_training()
""")


@pytest.mark.slow
def test_zero3_export_matches_training_model(tmp_path):
    from diffusers import UNet2DConditionModel

    proc = subprocess.run([sys.executable, "-c", TRAIN_AND_PROBE, str(tmp_path)], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "export"
    proc = run_cli("export", str(tmp_path / "checkpoints"), str(out), module="zerotune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = torch.load(tmp_path / "probe.pt", weights_only=False)
    unet = UNet2DConditionModel.from_pretrained(out / "unet", local_files_only=True).eval()
    with torch.no_grad():
        y = unet(probe["x"], probe["t"], encoder_hidden_states=None, class_labels=probe["labels"]).sample
    assert torch.allclose(y, probe["y"], rtol=0, atol=1e-6), (y - probe["y"]).abs().max()
    flat = load_file(str(out / "unet.safetensors"))
    assert flat.keys() == unet.state_dict().keys()
    assert all(torch.equal(flat[k], v) for k, v in unet.state_dict().items())
    ema = load_file(str(out / "unet_ema.safetensors"))
    assert all(torch.equal(ema[k], probe["ema"][k]) for k in probe["ema"])
    assert any(not torch.equal(ema[k], flat[k]) for k in flat), "EMA and raw weights differ after 2 steps"

    # model.pretrained=<exported folder> starts a new run from those weights.
    run = tmp_path / "from_export"
    proc = run_cli(f"model.pretrained={out}", "zero_stage=0", "train.max_steps=1", "train.batch_size=4", "scheduler=constant",
                   "evaluate.enabled=false", "checkpoint.every_n_steps=1", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_summary(run)["status"] == "ok"


def test_export_refuses_a_folder_without_checkpoints(tmp_path):
    proc = run_cli("export", str(tmp_path), str(tmp_path / "out"), module="zerotune")
    assert proc.returncode != 0 and "not a complete checkpoint" in proc.stderr

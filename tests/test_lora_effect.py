"""adapter=lora has a real effect: a U-Net trained on the digits draws them as they are; a LoRA fine-tune of it on
the digits drawn inverted (data.invert=true) makes it draw them inverted, and its export does the same when loaded
by diffusers' own LoRA loader into the base, and merged into it.

The figures (run with -s to see them): the share of samples drawn on bright paper (quality.inverted_fraction), the
accuracy of a classifier fitted on the inverted real digits, and of one fitted on the real digits as they are.
Samples come from zerotune's sampler with the default job's settings (DPM-Solver++, 20 steps, guidance 3).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.cli import compose_cfg, read_summary, run_cli
from zerotune.models import latent_shape
from zerotune.models.diffusion import noise_scheduler, sample_images
from zerotune.train.evaluate import DigitClassifier, inverted_fraction

pytestmark = pytest.mark.slow

BASE_STEPS, LORA_STEPS = 150, 300   # the base's samples are recognisable after 150 (20/20 per digit measured)
# The 2.4M-parameter width these figures were measured at (docs/results.md, LoRA): at the default 0.6M width a rank-16
# adapter on the convolutions is a quarter of the model, not the small fraction this test asserts.
WIDTH = "model.unet.block_out_channels=[64,128]"
PER_CLASS = 20                      # samples per digit scored
WEIGHTS = "pytorch_lora_weights.safetensors"


def train(run_dir, steps: int, *args: str) -> dict:
    t0 = time.perf_counter()
    proc = run_cli(WIDTH, *args, f"train.max_steps={steps}", f"checkpoint.every_n_steps={steps}", "evaluate.enabled=false",
                   f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    return {**summary, "command_s": time.perf_counter() - t0}


def export(run_dir, out, *flags: str) -> None:
    proc = run_cli("export", str(run_dir), str(out), *flags, module="zerotune")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base (normal digits, full training), its LoRA fine-tune on the inverted digits, both exported."""
    root = tmp_path_factory.mktemp("lora_effect")
    t0 = time.perf_counter()
    base = train(root / "base", BASE_STEPS)
    export(root / "base", root / "base_out")
    lora = train(root / "lora", LORA_STEPS, f"model.pretrained={root / 'base_out' / 'unet'}", "adapter=lora",
                 "data.invert=true")
    export(root / "lora", root / "lora_out", "--merge")
    print(f"\n[lora-effect] base: {BASE_STEPS} steps, {base['train_time_s']:.1f} s training "
          f"({base['command_s']:.1f} s command), {base['trainable_params']:,} trainable params; "
          f"lora: {LORA_STEPS} steps, {lora['train_time_s']:.1f} s training ({lora['command_s']:.1f} s command), "
          f"{lora['trainable_params']:,} trainable params; adapter file "
          f"{(root / 'lora_out' / 'lora' / WEIGHTS).stat().st_size:,} bytes; all: {time.perf_counter() - t0:.1f} s")
    return {"root": root, "base": base, "lora": lora}


@pytest.fixture(scope="module")
def classifiers():
    return DigitClassifier(), DigitClassifier(invert=True)


def scores(unet, classifiers, name: str) -> dict:
    """Sample PER_CLASS of each digit from `unet` as the default job's evaluation does, and score them."""
    cfg = compose_cfg()
    labels = torch.arange(10).repeat_interleave(PER_CLASS)
    t0 = time.perf_counter()
    images = sample_images(unet.float().eval(), dict(noise_scheduler(cfg.diffusion).config), labels,
                           latent_shape(cfg.model, cfg.resolution.size), int(cfg.evaluate.steps),
                           float(cfg.evaluate.guidance_scale), torch.Generator().manual_seed(0),
                           cfg.diffusion.prediction_type)
    upright, inverted = classifiers
    out = {"inverted_fraction": inverted_fraction(images), "inverted_accuracy": inverted.accuracy(images, labels),
           "accuracy": upright.accuracy(images, labels)}
    print(f"\n[lora-effect] {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items())
          + f" ({len(labels)} samples, {time.perf_counter() - t0:.1f} s)")
    return out


def base_unet(runs):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(runs["root"] / "base_out" / "unet")


def assert_inverted(got: dict) -> None:
    assert got["inverted_fraction"] >= 0.9, got
    assert got["inverted_accuracy"] >= 0.8, got
    assert got["accuracy"] <= 0.3, got  # no longer read as normal digits


def test_the_base_draws_normal_digits(runs, classifiers):
    got = scores(base_unet(runs), classifiers, "base")
    assert got["accuracy"] >= 0.8, got            # recognisable
    assert got["inverted_fraction"] <= 0.1, got   # on dark paper
    assert got["inverted_accuracy"] <= 0.3, got   # chance, for the inverted-digit classifier


def test_only_the_adapter_trained(runs):
    base, lora = runs["base"], runs["lora"]
    assert lora["frozen_params"] == base["num_params"]
    assert lora["num_params"] == base["num_params"] + lora["trainable_params"]
    assert lora["trainable_params"] < base["trainable_params"] / 5
    assert lora["loss_last"] < lora["loss_first"] / 2   # it learned the inverted digits


def test_the_adapter_loaded_by_diffusers_draws_inverted_digits(runs, classifiers):
    unet = base_unet(runs)
    unet.load_lora_adapter(str(runs["root"] / "lora_out" / "lora"), prefix="unet", weight_name=WEIGHTS)
    assert_inverted(scores(unet, classifiers, "base + adapter (diffusers' load_lora_adapter)"))


def test_the_merged_export_draws_inverted_digits(runs, classifiers):
    from diffusers import UNet2DConditionModel

    merged = UNet2DConditionModel.from_pretrained(runs["root"] / "lora_out" / "unet")
    assert_inverted(scores(merged, classifiers, "merged (--merge)"))

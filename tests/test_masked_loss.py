"""data.masked_loss: each image's <stem>.mask.png (or its alpha channel), cropped with the image into its bucket,
cached at the latents' resolution, and the loss weighted by it as kohya's apply_masked_loss weights it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.helpers.cli import compose_cfg, config_of, read_summary, run_cli
from tests.helpers.fixes import refused_with_fixes
from zerotune.data.buckets import Ref
from zerotune.data.prepare import prepare_folder_data
from zerotune.data.spec import DataSpec
from zerotune.models.diffusion import NoisePrediction, noise_scheduler, objective_of
from zerotune.models.flow_matching import FlowMatching


def _kohya(loss: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
    """sd-scripts' library/custom_train_functions.py apply_masked_loss, then train_network.py's mean."""
    mask = F.interpolate(pixel_mask, size=loss.shape[2:], mode="area")
    return (loss * mask).mean([1, 2, 3]).mean()


@pytest.mark.parametrize("objective", ["ddpm", "flow"])
def test_the_masked_loss_is_kohyas(objective):
    g = torch.Generator().manual_seed(0)
    x0, noise, pred = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    pixel_mask = (torch.rand(2, 1, 64, 64, generator=g) > 0.5).float()
    latent_mask = F.interpolate(pixel_mask, size=(8, 8), mode="area")
    if objective == "ddpm":
        obj = NoisePrediction(noise_scheduler(replace(config_of().diffusion, prediction_type="epsilon")))
        t = torch.tensor([10, 900])
        got = obj.loss(lambda noisy, tt: pred, x0, noise, t, latent_mask)
        want = _kohya(F.mse_loss(pred, noise, reduction="none"), pixel_mask)
    else:
        obj = FlowMatching.of(config_of("model=sd3_tiny").model, config_of("model=sd3_tiny").diffusion)
        got = obj.loss(lambda noisy, tt: pred, x0, noise, torch.tensor([3, 700]), latent_mask)
        want = _kohya((pred - (noise - x0)) ** 2, pixel_mask)  # weighting_scheme none: weights of 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def masked_folder(tmp_path_factory) -> Path:
    """Four 64x64 images: two with a <stem>.mask.png black on its left half, one with an alpha channel (opaque on
    its top half), one with neither."""
    root = tmp_path_factory.mktemp("masked")
    rng = np.random.default_rng(2)
    half = np.zeros((64, 64), dtype=np.uint8)
    half[:, 32:] = 255
    for i in range(4):
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        if i == 2:
            alpha = np.zeros((64, 64, 1), dtype=np.uint8)
            alpha[:32] = 255
            Image.fromarray(np.concatenate([pixels, alpha], axis=2), "RGBA").save(root / f"{i}.png")
        else:
            Image.fromarray(pixels).save(root / f"{i}.png")
        if i < 2:
            Image.fromarray(half).save(root / f"{i}.mask.png")
        (root / f"{i}.txt").write_text("a red dog")
    return root


def _overrides(folder: Path, components: Path, cache: Path, *extra: str) -> list[str]:
    return ["model=sdxl_tiny", "data=folder", f"data.path={folder}", f"model.components={components}",
            "resolution.size=64", "train.batch_size=2", f"data.cache_dir={cache}", "data.masked_loss=true", *extra]


def test_masks_are_cropped_with_their_image_and_cached_at_the_latents_resolution(masked_folder, tiny_sdxl_components,
                                                                                 tmp_path):
    spec = DataSpec.from_config(compose_cfg(*_overrides(masked_folder, tiny_sdxl_components, tmp_path / "c",
                                                        "data.random_flip=true")))
    dataset, report = prepare_folder_data(spec, progress=False)
    assert report["images_found"] == 4  # the masks are no images
    assert report["masks"] == {"masked_loss": True, "mask_files": 2, "alpha_channels": 1, "unmasked": 1}
    by_name = {it.record.rel: i for i, it in enumerate(dataset.items)}
    left_black = dataset[Ref(by_name["0.png"])]["mask"]
    assert left_black.shape == (1, 16, 16)  # 64 px / the VAE's 4
    assert left_black[..., :8].max() == 0 and left_black[..., 8:].min() == 1
    mirrored = dataset[Ref(by_name["0.png"], flipped=True)]["mask"]
    assert torch.equal(mirrored, left_black.flip(-1))
    top_opaque = dataset[Ref(by_name["2.png"])]["mask"]
    assert top_opaque[:, :8].min() == 1 and top_opaque[:, 8:].max() == 0
    assert torch.equal(dataset[Ref(by_name["3.png"])]["mask"], torch.ones(1, 16, 16))
    _, again = prepare_folder_data(spec, progress=False)
    assert again["cache"]["latents_reused"] == 8  # the masks add no VAE work


def test_a_masked_left_half_gets_no_gradient_from_the_loss(masked_folder, tiny_sdxl_components, tmp_path):
    """The tiny U-Net's prediction for an image masked on its left half: the loss's gradient on the prediction (the
    U-Net's output, what reaches its weights) is zero over the left half of the latent grid, and not on the right."""
    from zerotune.models import build_network
    from zerotune.models.diffusion import unet_kwargs

    cfg = config_of(*_overrides(masked_folder, tiny_sdxl_components, tmp_path / "c"))
    dataset, _ = prepare_folder_data(DataSpec.from_config(cfg), progress=False)
    sample = dataset[Ref(next(i for i, it in enumerate(dataset.items) if it.record.rel == "0.png"))]
    batch = {k: v[None] for k, v in sample.items()}
    torch.manual_seed(0)
    unet = build_network(cfg.model)
    outputs = []

    def predict(noisy, t):
        out = unet(noisy, t, **unet_kwargs("text_time", batch)).sample
        out.retain_grad()
        outputs.append(out)
        return out

    g = torch.Generator().manual_seed(1)
    loss = objective_of(cfg.model, cfg.diffusion).loss(predict, batch["x0"], torch.randn(batch["x0"].shape, generator=g),
                                                       torch.tensor([500]), batch["mask"])
    loss.backward()
    grad = outputs[0].grad
    assert grad[..., :8].abs().max() == 0 and grad[..., 8:].abs().min() > 0


@pytest.mark.parametrize("stage", ["2", "3"])
def test_masked_loss_trains_end_to_end(stage, masked_folder, tiny_sdxl_components, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*_overrides(masked_folder, tiny_sdxl_components, tmp_path / "c"), f"zero_stage={stage}",
                   "train.max_steps=3", f"hydra.run.dir={run}", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["data"]["masks"]["mask_files"] == 2


def test_masked_loss_without_a_folder_is_refused_with_a_fix(tmp_path):
    overrides = ["model=sdxl_tiny", "data=synthetic", "data.masked_loss=true"]

    err, fixes = refused_with_fixes(overrides, tmp_path)
    assert err.key == "data.masked_loss" and "masks" in err.problem
    assert fixes >= 1

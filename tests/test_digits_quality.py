"""Digits data, the real-digit scorer, the PNG grid and the CFG sampler (all CPU, a few seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.cli import compose_cfg
from zerotune.data.sources import DigitsDataset, split_indices
from zerotune.models import build_network
from zerotune.models.diffusion import NULL_CLASS, sample_images, unet_kwargs
from zerotune.train.evaluate import DigitClassifier, save_grid

SIZE = 8  # the default job trains on the digits at their own 8x8


@pytest.fixture(scope="module")
def classifier() -> DigitClassifier:
    return DigitClassifier(holdout_fraction=0.2, seed=0)


@pytest.fixture(scope="module")
def tiny_unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_network(compose_cfg().model)


def test_dataset_shapes_ranges_and_balance() -> None:
    ds = DigitsDataset(SIZE)
    assert len(ds) == 1797
    item = ds[0]
    assert item["x0"].shape == (1, SIZE, SIZE)
    assert item["x0"].dtype == torch.float32
    assert item["class_labels"].dtype == torch.long and item["class_labels"].ndim == 0
    assert ds.pixel_values.min() >= -1 and ds.pixel_values.max() <= 1
    # Background is 0 -> -1 and strokes reach 16 -> close to +1, so the full range is used.
    assert ds.pixel_values.min() == -1 and ds.pixel_values.max() > 0.9
    counts = torch.bincount(ds.class_labels, minlength=10)
    assert counts.min() >= 170 and counts.max() <= 190


def test_dataset_holdout_split_is_stratified_and_disjoint() -> None:
    labels = DigitsDataset(8, split="all").class_labels.numpy()
    train_idx, holdout_idx = split_indices(labels, 0.2, seed=1)
    assert np.intersect1d(train_idx, holdout_idx).size == 0
    assert np.union1d(train_idx, holdout_idx).size == len(labels)
    holdout = DigitsDataset(8, split="holdout", holdout_fraction=0.2, seed=1)
    assert torch.equal(holdout.class_labels, torch.from_numpy(labels[holdout_idx]))
    assert abs(len(holdout) - 0.2 * len(labels)) <= 10
    assert torch.bincount(holdout.class_labels, minlength=10).min() >= 34


def test_classifier_is_accurate_on_held_out_real_digits(classifier: DigitClassifier) -> None:
    assert classifier.holdout_accuracy is not None and classifier.holdout_accuracy >= 0.95
    # Scored through the image path too (upsampled to SIZE, then area-averaged back to 8x8).
    holdout = DigitsDataset(SIZE, split="holdout", holdout_fraction=0.2, seed=0)
    fitted_on_train_only = DigitClassifier(holdout_fraction=0.2, seed=0, refit_on_all=False)
    assert fitted_on_train_only.accuracy(holdout.pixel_values, holdout.class_labels) >= 0.95
    per_class = fitted_on_train_only.per_class_accuracy(holdout.pixel_values, holdout.class_labels)
    assert sorted(per_class) == list(range(10)) and min(per_class.values()) >= 0.85


def test_classifier_is_near_chance_on_noise(classifier: DigitClassifier) -> None:
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(500, 1, SIZE, SIZE, generator=g) * 2 - 1
    labels = torch.arange(10).repeat(50)
    assert classifier.accuracy(noise, labels) < 0.3


def test_save_grid_writes_png_of_expected_size(tmp_path) -> None:
    labels = torch.arange(10).repeat_interleave(3)
    images = torch.rand(len(labels), 1, SIZE, SIZE) * 2 - 1
    path = save_grid(images, labels, tmp_path / "sub" / "grid.png", nrow=3, cell_px=64, pad_px=2)
    with Image.open(path) as png:
        assert png.size == (3 * 64 + 4 * 2, 10 * 64 + 11 * 2)
        pixels = np.asarray(png)
    # First cell of the first row is the first class-0 image, nearest-upscaled.
    expected = ((images[0, 0].clamp(-1, 1) + 1) * 127.5).round().numpy()
    cell = pixels[2 : 2 + 64 : 64 // SIZE, 2 : 2 + 64 : 64 // SIZE]
    assert np.abs(cell.astype(float) - expected).max() <= 1


def test_tiny_unet_accepts_class_labels_without_encoder_states(tiny_unet: torch.nn.Module) -> None:
    assert tiny_unet.config.num_class_embeds == NULL_CLASS + 1
    x = torch.randn(4, 1, SIZE, SIZE)
    labels = torch.tensor([0, 3, 9, NULL_CLASS])
    out = tiny_unet(x, torch.tensor([0, 10, 500, 999]), **unet_kwargs("class", {"class_labels": labels})).sample
    assert out.shape == x.shape
    # Different labels must give different outputs: the class embedding reaches the network.
    out2 = tiny_unet(x, torch.tensor([0, 10, 500, 999]), **unet_kwargs("class", {"class_labels": labels.flip(0)})).sample
    assert not torch.allclose(out, out2)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_sample_images_shape_range_determinism(tiny_unet: torch.nn.Module, prediction_type: str) -> None:
    from diffusers import DDPMScheduler

    config = DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type=prediction_type
    ).config
    labels = torch.tensor([0, 1, 2, 7, 9])
    tiny_unet.train()

    def run(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return sample_images(tiny_unet, config, labels, (1, SIZE, SIZE), 4, 2.0, g, prediction_type)

    a, b, c = run(0), run(0), run(1)
    assert a.shape == (5, 1, SIZE, SIZE) and a.dtype == torch.float32
    assert a.min() >= -1 and a.max() <= 1 and torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert tiny_unet.training  # the sampler restores the caller's train/eval mode

"""Scoring generated digits: a grid per class sampled with the trained weights, scored by a classifier fitted on the
real sklearn digits (drawn as they are, or inverted); the samples' ink polarity; a PNG grid writer."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.svm import SVC

from zerotune.config.schema import Config
from zerotune.data.sources import DIGITS_MAX, invert_digits, split_indices, unit_range_to_digits
from zerotune.models import adapter, build_network
from zerotune.models.diffusion import sample_images
from zerotune.rundir import SAMPLES, RunDir

if TYPE_CHECKING:
    from zerotune.train.trainer import Trainer


def to_digit_features(images: torch.Tensor) -> np.ndarray:
    """[N, 1, H, W] in [-1, 1] -> [N, 64] raw-digit features (0..16), area-averaged down to 8x8."""
    if images.ndim != 4 or images.shape[1] != 1:
        raise ValueError(f"expected images of shape [N, 1, H, W], got {tuple(images.shape)}")
    small = F.adaptive_avg_pool2d(images.detach().float().cpu(), 8)
    return unit_range_to_digits(small).reshape(len(images), 64).numpy()


class DigitClassifier:
    """RBF SVC on the 64 raw digit pixels (fits in well under a second). With holdout_fraction > 0 it records the
    accuracy on held-out real digits (`holdout_accuracy`), then with `refit_on_all` refits on all 1797 images.
    `invert`: fitted on the digits drawn inverted (raw x -> 16 - x, as data.invert=true trains on)."""

    def __init__(self, holdout_fraction: float = 0.2, seed: int = 0, refit_on_all: bool = True,
                 invert: bool = False) -> None:
        digits = load_digits()
        x, y = digits.data.astype(np.float64), digits.target.astype(np.int64)
        if invert:
            x = invert_digits(x)
        self.holdout_accuracy: float | None = None
        if holdout_fraction > 0:
            train, holdout = split_indices(y, holdout_fraction, seed)
            model = self._new_model().fit(x[train], y[train])
            self.holdout_accuracy = float((model.predict(x[holdout]) == y[holdout]).mean())
            self.model = model
        if holdout_fraction == 0 or refit_on_all:
            self.model = self._new_model().fit(x, y)

    @staticmethod
    def _new_model() -> SVC:
        # gamma suits raw 0..16 features (64 dims); ~99% held-out accuracy on real digits.
        return SVC(C=10.0, gamma=0.001)

    def predict(self, images: torch.Tensor) -> np.ndarray:
        return self.model.predict(to_digit_features(images))

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor | np.ndarray) -> float:
        return float((self.predict(images) == _as_numpy(labels)).mean())

    def per_class_accuracy(self, images: torch.Tensor, labels: torch.Tensor | np.ndarray) -> dict[int, float]:
        labels = _as_numpy(labels)
        correct = self.predict(images) == labels
        return {int(c): float(correct[labels == c].mean()) for c in np.unique(labels)}


def border_brightness(images: torch.Tensor) -> np.ndarray:
    """Per image, the mean of the 28 border pixels of its 8x8 digit (raw units 0..16): the paper's shade.
    Real digits: 1.1 to 4.8 (ink touches the edges a little); drawn inverted: 11.2 to 14.9."""
    small = to_digit_features(images).reshape(len(images), 8, 8)
    border = np.ones((8, 8), dtype=bool)
    border[1:-1, 1:-1] = False
    return small[:, border].mean(axis=1)


def inverted_fraction(images: torch.Tensor) -> float:
    """The fraction of images drawn on bright paper (border brighter than mid-grey): ~0 for real digits,
    ~1 for inverted ones."""
    return float((border_brightness(images) > DIGITS_MAX / 2).mean())


def save_samples(images: torch.Tensor, labels: torch.Tensor | np.ndarray, path: str | Path) -> Path:
    """The scored samples as they came from the sampler (float32 [N, 1, H, W] in [-1, 1]) with their classes,
    so that anyone can score them again: `load_samples` gives them back."""
    path = Path(path)
    np.savez_compressed(path, images=images.detach().float().cpu().numpy(), labels=_as_numpy(labels))
    return path


def load_samples(path: str | Path) -> tuple[torch.Tensor, np.ndarray]:
    with np.load(path) as f:
        return torch.from_numpy(f["images"]), f["labels"]


def _as_numpy(labels: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        return labels.detach().cpu().numpy()
    return np.asarray(labels)


def save_grid(
    images: torch.Tensor,
    labels: torch.Tensor | np.ndarray | Sequence[int],
    path: str | Path,
    nrow: int,
    cell_px: int = 64,
    pad_px: int = 2,
) -> Path:
    """Write a grayscale PNG, one row per class (sorted) of up to `nrow` images, each upscaled (nearest) to `cell_px`
    square, with `pad_px` of mid-grey between: (nrow * cell_px + (nrow + 1) * pad_px) wide, likewise high."""
    labels_np = _as_numpy(labels)
    if len(labels_np) != len(images):
        raise ValueError(f"{len(images)} images but {len(labels_np)} labels")
    classes = np.unique(labels_np)
    cells = F.interpolate(images.detach().float().cpu().clamp(-1, 1), size=(cell_px, cell_px), mode="nearest")
    cells = ((cells[:, 0] + 1) * 127.5).round().to(torch.uint8).numpy()

    step = cell_px + pad_px
    grid = np.full((len(classes) * step + pad_px, nrow * step + pad_px), 128, dtype=np.uint8)
    for row, c in enumerate(classes):
        for col, i in enumerate(np.flatnonzero(labels_np == c)[:nrow]):
            top, left = pad_px + row * step, pad_px + col * step
            grid[top : top + cell_px, left : left + cell_px] = cells[i]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(path)  # 2-D uint8 -> grayscale "L" PNG
    return path


log = logging.getLogger(__name__)


def evaluate_digits(trainer: Trainer, cfg: Config, run_dir: RunDir) -> dict | None:
    """Accuracy of class-conditional samples, as judged by an SVC trained on the real digits."""
    use_ema = bool(cfg.ema.enabled and cfg.ema.use_for_samples)
    state = trainer.full_state_dict(use_ema)  # every rank: a collective under ZeRO-3
    if not trainer.accelerator.is_main_process:
        return None
    t0 = time.perf_counter()
    unet = adapter.add_adapter(build_network(cfg.model), cfg.adapter).float()
    unet.load_state_dict(state)
    unet.eval()
    ev = cfg.evaluate
    labels = torch.arange(10).repeat_interleave(int(ev.per_class))
    schedule = dict(trainer.noise_schedule.config)  # type: ignore[attr-defined]  # diffusers' ConfigMixin
    images = sample_images(unet, schedule, labels, trainer.resolved.input_shape,
                           int(ev.steps), float(ev.guidance_scale), torch.Generator().manual_seed(cfg.train.seed),
                           cfg.diffusion.prediction_type)
    clf = DigitClassifier()
    grid, samples = run_dir.path / SAMPLES / "grid.png", run_dir.path / SAMPLES / "samples.npz"
    if run_dir.is_writer:
        save_grid(images, labels, grid, nrow=min(int(ev.per_class), 10))
        save_samples(images, labels, samples)  # the very tensors scored below
    result: dict[str, Any] = {"digit_accuracy": clf.accuracy(images, labels),
              "per_class_accuracy": {str(k): v for k, v in clf.per_class_accuracy(images, labels).items()},
              "samples": len(labels), "weights": "ema" if use_ema else "model",
              "sampling_s": time.perf_counter() - t0, "grid": str(grid.relative_to(run_dir.path)),
              "samples_file": str(samples.relative_to(run_dir.path))}
    log.info("digit accuracy %.1f%% over %d samples (%s weights)", 100 * result["digit_accuracy"], len(labels),
             result["weights"])
    return result

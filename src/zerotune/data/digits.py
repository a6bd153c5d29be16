"""scikit-learn's 8x8 digits as an in-memory image data set for class-conditional diffusion."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import Dataset

DIGITS_MAX = 16.0  # load_digits pixel values are integers 0..16


def digits_to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """Map raw digit intensities 0..16 linearly to [-1, 1] (0 -> -1, 8 -> 0, 16 -> 1)."""
    return pixels / (DIGITS_MAX / 2) - 1.0


def unit_range_to_digits(images: torch.Tensor) -> torch.Tensor:
    """Inverse of `digits_to_unit_range`, clamped to the valid 0..16 range."""
    return ((images.clamp(-1, 1) + 1.0) * (DIGITS_MAX / 2)).clamp(0, DIGITS_MAX)


def invert_digits(pixels: torch.Tensor | np.ndarray):
    """Raw digit intensities with ink and paper swapped: x -> 16 - x, inside the same 0..16 range."""
    return DIGITS_MAX - pixels


def split_indices(labels: np.ndarray, holdout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified (train, holdout) index split, so both parts keep the 10 classes balanced."""
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    rng = np.random.default_rng(seed)
    train, holdout = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_hold = int(round(holdout_fraction * len(idx)))
        holdout.append(idx[:n_hold])
        train.append(idx[n_hold:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(holdout))


class DigitsDataset(Dataset):
    """The 1797 sklearn digits, upsampled to `size` x `size`, one channel.

    Pixel values: raw intensities 0..16 map linearly to [-1, 1] (x / 8 - 1), then the 8x8 image is
    resized bilinearly (align_corners=False) to `size`; bilinear keeps the range inside [-1, 1] and
    2x2 area-averaging of a 16x16 image recovers the 8x8 digit closely, which is what the scorer does.

    `split` is "train" (the default, with holdout_fraction=0 that is all 1797 images), "holdout" or
    "all"; the split is stratified by class and fixed by `seed`. `invert`: every digit drawn inverted
    (raw x -> 16 - x before the mapping, so paper is 1 and ink -1).
    Items: {"x0": FloatTensor[1, size, size] in [-1, 1], "class_labels": LongTensor scalar}.
    """

    def __init__(self, size: int, split: str = "train", holdout_fraction: float = 0.0, seed: int = 0,
                 invert: bool = False) -> None:
        digits = load_digits()
        labels = digits.target.astype(np.int64)
        train_idx, holdout_idx = split_indices(labels, holdout_fraction, seed)
        indices = {"train": train_idx, "holdout": holdout_idx, "all": np.arange(len(labels))}
        if split not in indices:
            raise ValueError(f"split must be one of {sorted(indices)}, got {split!r}")
        idx = indices[split]

        raw = torch.from_numpy(digits.images[idx]).float()
        images = digits_to_unit_range(invert_digits(raw) if invert else raw).unsqueeze(1)
        if size != images.shape[-1]:
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
        # One contiguous tensor each: indexing is all __getitem__ does.
        self.pixel_values = images.clamp(-1, 1).contiguous()
        self.class_labels = torch.from_numpy(labels[idx])

    def __len__(self) -> int:
        return self.class_labels.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x0": self.pixel_values[i], "class_labels": self.class_labels[i]}

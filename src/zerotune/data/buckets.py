"""SDXL-style aspect-ratio buckets (for 1024: 512x2048, ..., 1024x1024, ..., 2048x512), where an image lands in its
bucket (nearest in log aspect ratio, resized to cover it, centre-cropped), and a seeded sampler whose batches never
mix buckets. A bucket's remainder sits out one epoch only; a bucket smaller than a batch is never trained on."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from torch.utils.data import Sampler

Bucket = tuple[int, int]  # (width, height) in pixels


def make_buckets(size: int, step: int = 64, max_ratio: float = 4.0) -> list[Bucket]:
    """The bucket set for a target of size x size pixels, sorted by aspect ratio (tall to wide)."""
    area = size * size
    if step <= 0 or size < step:
        raise ValueError(f"size {size} must be at least one step ({step})")
    out = set()
    for w in range(step, area // step + 1, step):
        h = (area // w) // step * step  # the tallest that fits, as SDXL's (and kohya's) lists do
        if h >= step and max(w, h) / min(w, h) <= max_ratio:
            out.update({(w, h), (h, w)})
    return sorted(out, key=lambda b: (b[0] / b[1], b[0]))


def closest_bucket(width: int, height: int, buckets: list[Bucket]) -> Bucket:
    """The bucket nearest in log aspect ratio (so 2:1 and 1:2 are equally far from 1:1)."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))


@dataclass(frozen=True)
class Placement:
    """How one image becomes one bucket-sized crop; everything the pixels and time_ids need."""
    orig_w: int
    orig_h: int
    resized_w: int
    resized_h: int
    bucket: Bucket
    crop_left: int
    crop_top: int

    @property
    def upscales(self) -> bool:
        return self.resized_w > self.orig_w or self.resized_h > self.orig_h

    def mirrored_crop_left(self) -> int:
        """Where the same crop starts once the resized image is flipped left-right."""
        return self.resized_w - self.bucket[0] - self.crop_left

    def time_ids(self, flipped: bool = False) -> list[float]:
        """SDXL's added time ids: original (h, w), crop (top, left), target (h, w)."""
        left = self.mirrored_crop_left() if flipped else self.crop_left
        w, h = self.bucket
        return [float(self.orig_h), float(self.orig_w), float(self.crop_top), float(left), float(h), float(w)]


def place(width: int, height: int, bucket: Bucket) -> Placement:
    """Resize to cover the bucket, keeping the aspect ratio, then centre the crop."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    return Placement(width, height, rw, rh, bucket, (rw - bw) // 2, (rh - bh) // 2)


def bucket_name(bucket: Bucket) -> str:
    return f"{bucket[0]}x{bucket[1]}"


class Ref(NamedTuple):
    """A sample and the draws made for it this epoch."""
    sample: int             # its position in the data set
    flipped: bool = False   # the mirrored view (data.random_flip)
    variant: int = 0        # which of its caption's cached variants (data.shuffle_tags)
    dropped: bool = False   # the empty caption in its place (data.caption_dropout)


SampleRef = int | tuple[int, bool] | Ref


class BucketBatchSampler(Sampler[list[SampleRef]]):
    """Each epoch, every bucket's shuffled samples in whole batches, all buckets' batches shuffled together; with
    random_flip, (index, flipped) pairs (the flipped view's latents were encoded from mirrored pixels); with caption
    variants or caption dropout, Refs carrying those draws too. Every draw comes from the seed and the epoch."""

    def __init__(self, buckets: Sequence[Bucket], batch_size: int, seed: int, random_flip: bool = False,
                 caption_variants: int = 1, caption_dropout: float = 0.0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.seed, self.random_flip = batch_size, seed, random_flip
        self.caption_variants, self.caption_dropout = caption_variants, caption_dropout
        self.drop_last = True  # what accelerate reads to know batches are whole
        groups: dict[Bucket, list[int]] = {}
        for index, bucket in enumerate(buckets):
            groups.setdefault(bucket, []).append(index)
        self._groups = [np.asarray(groups[b]) for b in sorted(groups)]
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """accelerate calls this with a single process; otherwise each pass counts one epoch on."""
        self._epoch = epoch

    def __len__(self) -> int:
        return sum(len(g) // self.batch_size for g in self._groups)

    def __iter__(self) -> Iterator[list[SampleRef]]:
        rng = np.random.default_rng([self.seed, self._epoch])
        self._epoch += 1
        batches: list[np.ndarray] = []
        for group in self._groups:
            shuffled = rng.permutation(group)
            whole = len(shuffled) // self.batch_size * self.batch_size
            batches.extend(shuffled[:whole].reshape(-1, self.batch_size))
        captions = self.caption_variants > 1 or self.caption_dropout > 0
        for i in rng.permutation(len(batches)):
            batch = batches[i]
            flips = rng.random(len(batch)) < 0.5 if self.random_flip else np.zeros(len(batch), dtype=bool)
            if captions:  # drawn after the flips: a run without caption rules keeps its draws
                variants = rng.integers(self.caption_variants, size=len(batch))
                dropped = rng.random(len(batch)) < self.caption_dropout
                yield [Ref(int(index), bool(f), int(v), bool(d))
                       for index, f, v, d in zip(batch, flips, variants, dropped, strict=True)]
            elif self.random_flip:
                yield [(int(index), bool(f)) for index, f in zip(batch, flips, strict=True)]
            else:
                yield [int(index) for index in batch]


def batches_per_bucket(buckets: Sequence[Bucket], batch_size: int) -> dict[str, dict[str, int]]:
    """Per bucket: samples, whole batches per epoch, and samples sitting out each epoch."""
    counts = Counter(buckets)
    return {bucket_name(b): {"samples": n, "batches_per_epoch": n // batch_size, "left_out_per_epoch": n % batch_size}
            for b, n in sorted(counts.items())}

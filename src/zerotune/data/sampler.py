"""Batches that never mix buckets: a seeded, deterministic batch sampler.

Each epoch, every bucket's samples are shuffled and cut into whole batches; the batches of all buckets
are then shuffled together. A bucket's remainder (fewer than a batch) sits out that epoch only: the
next epoch's shuffle leaves out different samples, so over epochs every sample is seen. A bucket with
fewer samples than one batch is never trained on; `batches_per_bucket` says so, and the data report lists it.

With random_flip, each drawn sample also gets a coin flip, and the sampler yields (index, flipped)
pairs: the dataset returns the flipped view, whose latents were encoded from mirrored pixels.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from zerotune.data.buckets import Bucket, bucket_name

SampleRef = int | tuple[int, bool]


class BucketBatchSampler(Sampler[list[SampleRef]]):
    def __init__(self, buckets: Sequence[Bucket], batch_size: int, seed: int, random_flip: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.seed, self.random_flip = batch_size, seed, random_flip
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
        for i in rng.permutation(len(batches)):
            batch = batches[i]
            if self.random_flip:
                flips = rng.random(len(batch)) < 0.5
                yield [(int(index), bool(f)) for index, f in zip(batch, flips, strict=True)]
            else:
                yield [int(index) for index in batch]


def batches_per_bucket(buckets: Sequence[Bucket], batch_size: int) -> dict[str, dict[str, int]]:
    """Per bucket: samples, whole batches per epoch, and samples sitting out each epoch."""
    counts = Counter(buckets)
    return {bucket_name(b): {"samples": n, "batches_per_epoch": n // batch_size, "left_out_per_epoch": n % batch_size}
            for b, n in sorted(counts.items())}

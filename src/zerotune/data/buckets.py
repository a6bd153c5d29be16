"""SDXL-style aspect-ratio buckets, and where an image lands in its bucket.

Buckets are, for each width divisible by `step`, the tallest height divisible by `step` whose area
stays within size**2, and the same pairs turned on their side, with aspect ratios up to `max_ratio`:
for 1024, SDXL's 512x2048, 512x1984, ..., 832x1216, ..., 1024x1024, ..., 2048x512. An image goes to the bucket closest to it in log aspect
ratio, is resized (keeping its aspect) to cover the bucket, and centre-cropped to it; SDXL's time_ids
record the original size and the crop's top-left corner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

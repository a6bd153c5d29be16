"""Decode an image and cut its bucket-sized crop as the VAE takes it: RGB in [-1, 1], channels first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from zerotune.data.buckets import Placement

# A corrupt file can raise almost anything while it decodes (OSError, SyntaxError, struct.error,
# DecompressionBombError...): whatever it is, that one image is skipped, not the run.
DECODE_ERRORS = (Exception,)


def open_rgb(path: Path) -> Image.Image:
    """Decode the whole image, upright (EXIF orientation applied), in RGB."""
    with Image.open(path) as decoded:
        decoded.load()
        img = ImageOps.exif_transpose(decoded)
        if img.mode in ("RGBA", "LA", "PA", "P") or "transparency" in img.info:
            # Transparent pixels become white rather than whatever colour they happen to hold.
            rgba = img.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return img.convert("RGB")


def crop_pixels(img: Image.Image, placement: Placement) -> torch.Tensor:
    """The bucket crop as a float tensor [3, h, w] in [-1, 1]."""
    if img.size != (placement.orig_w, placement.orig_h):
        raise ValueError(f"decoded size {img.size} differs from the header's "
                         f"{(placement.orig_w, placement.orig_h)}")
    resized = img.resize((placement.resized_w, placement.resized_h), Image.Resampling.LANCZOS)
    bw, bh = placement.bucket
    crop = resized.crop((placement.crop_left, placement.crop_top, placement.crop_left + bw, placement.crop_top + bh))
    pixels = torch.from_numpy(np.asarray(crop, dtype=np.uint8).copy()).permute(2, 0, 1)
    return pixels.float() / 127.5 - 1.0

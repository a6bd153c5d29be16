"""A generated image folder with every case data=folder must handle, and what it should yield."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

# name -> (width, height, caption or None); at resolution.size=128 the buckets are
# 64x256, 64x192, 128x128, 192x64, 256x64.
GOOD = {
    "sq_a.png": (256, 256, "a red dog"),
    "sq_b.jpg": (160, 160, "a blue cat"),
    "sq_c.webp": (200, 180, None),
    "wide_a.png": (512, 128, "a wide photo"),
    "wide_b.png": (400, 100, "another wide photo"),
    "tall_a.png": (128, 512, "a tall photo"),
    "tall_b.jpg": (90, 300, None),
    "dogs/d2.png": (256, 256, "sidecar wins"),  # also in metadata.jsonl: the side-car is used
}
METADATA_ONLY = {"dogs/d1.png": "a dog", "dogs/puppies/p1.png": "a puppy"}
EXPECTED_BUCKET = {"sq_a.png": (128, 128), "sq_b.jpg": (128, 128), "sq_c.webp": (128, 128),
                   "wide_a.png": (256, 64), "wide_b.png": (256, 64), "tall_a.png": (64, 256),
                   "tall_b.jpg": (64, 192), "rot.jpg": (64, 192), "dogs/d1.png": (128, 128),
                   "dogs/d2.png": (128, 128), "dogs/puppies/p1.png": (128, 128)}
USED = sorted(EXPECTED_BUCKET)                 # 11 images
MISSING_CAPTIONS = ["sq_c.webp", "tall_b.jpg"]
REPEATS = "data.repeats={dogs:2,dogs/puppies:3}"
SAMPLES = 11 - 3 + 2 * 2 + 3                   # d1, d2 twice; p1 three times
CAPTIONS = 10                                  # the two uncaptioned images share the empty caption


def _noise(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def make_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, (w, h, caption)) in enumerate(GOOD.items()):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        _noise(w, h, i).save(path)
        if caption is not None:
            path.with_suffix(".txt").write_text(caption + "\n")
    (root / "dogs/puppies").mkdir(parents=True, exist_ok=True)
    _noise(256, 256, 20).save(root / "dogs/d1.png")
    _noise(128, 128, 21).save(root / "dogs/puppies/p1.png")
    rows = [{"file_name": "d1.png", "caption": "a dog"}, {"file_name": "d2.png", "caption": "meta loses"},
            {"file_name": "puppies/p1.png", "caption": "a puppy"}, {"file_name": "gone.png", "caption": "x"}]
    (root / "dogs/metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    # Stored 200x100 and tagged "rotate 90": shown (and bucketed) as 100x200.
    exif = Image.Exif()
    exif[0x0112] = 6
    _noise(200, 100, 22).save(root / "rot.jpg", exif=exif)
    (root / "rot.jpg").with_suffix(".txt").write_text("rotated")
    _noise(40, 40, 23).save(root / "tiny.png")                  # smaller than any bucket at 128
    (root / "tiny.txt").write_text("tiny")
    (root / "broken.png").write_bytes(b"\x89PNG this is not an image")  # unreadable header
    buf = io.BytesIO()
    _noise(256, 256, 24).save(buf, format="JPEG")
    (root / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 3])  # header fine, data cut
    (root / "notes.md").write_text("not data")
    (root / ".hidden").mkdir()
    _noise(128, 128, 25).save(root / ".hidden/ignored.png")
    return root


def noise_images(root: Path, captions: tuple[str, ...], count: int = 8, seed: int = 0) -> Path:
    """`count` random 64x64 images <i>.png in `root`, captioned by side-car files cycling through `captions`."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(captions[i % len(captions)])
    return root

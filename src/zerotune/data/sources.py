"""Where samples come from: random inputs of the model's exact shapes (memory and speed do not depend on their
values), scikit-learn's 8x8 digits, and a folder's images, captions and repeats, decoded to bucket crops."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from sklearn.datasets import load_digits
from torch.utils.data import Dataset

from zerotune.config.errors import ConfigError
from zerotune.data.buckets import Placement
from zerotune.data.spec import DataSpec
from zerotune.models.backbones import backbone_of


class SyntheticDataset(Dataset):
    """Deterministic per index, so every process and every resume sees the same items."""

    def __init__(self, spec: DataSpec, latent_shape: tuple[int, int, int]):
        model, widths = spec.model, backbone_of(spec.model).text_widths()
        self.n, self.shape, self.seed = spec.data.num_samples, latent_shape, spec.seed
        self.kind, self.pixel_size = model.conditioning, spec.resolution
        self.seq, self.num_classes = int(model.text_seq_len), int(model.num_classes)
        self.dim, self.pooled = widths.hidden, widths.pooled

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        item = {"x0": torch.randn(self.shape, generator=g)}
        if self.kind == "class":
            item["class_labels"] = torch.randint(self.num_classes, (), generator=g)
        else:
            s = float(self.pixel_size)
            item["encoder_hidden_states"] = torch.randn(self.seq, self.dim, generator=g)
            if self.kind == "text":  # SD 1.x / 2.x: nothing added
                return item
            if self.kind == "text_pooled":  # FLUX.1 / SD3: the pooled embedding, no time ids
                item["pooled_projections"] = torch.randn(self.pooled, generator=g)
                return item
            item["text_embeds"] = torch.randn(self.pooled, generator=g)
            # SDXL's time_ids: original size, crop top-left, target size.
            item["time_ids"] = torch.tensor([s, s, 0.0, 0.0, s, s])
        return item


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
    """The 1797 sklearn digits, one channel: raw 0..16 map to [-1, 1] (x / 8 - 1), then bilinear resizing to `size`
    keeps that range, and 2x2 area-averaging of a 16x16 image recovers the 8x8 digit closely (as the scorer does).
    `split`: "train" (all 1797 with holdout_fraction=0), "holdout" or "all", stratified by class and fixed by `seed`.
    `invert`: x -> 16 - x before the mapping (paper 1, ink -1).
    Items: {"x0": FloatTensor[1, size, size] in [-1, 1], "class_labels": LongTensor scalar}."""

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


log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
METADATA = "metadata.jsonl"
MASK_SUFFIX = ".mask.png"  # <image stem>.mask.png beside an image: its loss mask (white: trained, black: not)
# EXIF orientations 5..8 rotate by 90 degrees: the stored width and height swap on display.
_SWAPS_SIDES = {5, 6, 7, 8}


@dataclass(frozen=True)
class ImageRecord:
    path: Path
    rel: str                 # posix path relative to data.path: the image's name in reports
    width: int               # as displayed, after the EXIF orientation is applied
    height: int
    caption: str
    caption_source: str      # "sidecar" | "metadata" | "missing"
    repeats: int
    mask: Path | None = None  # its <stem>.mask.png, if there is one


@dataclass
class Skipped:
    rel: str
    reason: str


@dataclass
class ScanResult:
    records: list[ImageRecord] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # unreadable images
    # Bad metadata.jsonl lines, entries naming no image, unreadable caption files or folders.
    problems: list[str] = field(default_factory=list)
    other_files: int = 0                                  # neither image, caption nor metadata
    masks: int = 0                                        # <stem>.mask.png files beside an image


def scan_folder(root: Path, repeats: Mapping[str, int] | None = None) -> ScanResult:
    """Every supported image under `root`, with its caption, display size and repeat count; decodes nothing. A
    caption is a side-car `<stem>.txt`, else a metadata.jsonl line ({"file_name", "caption"}) in its folder or one
    above inside `root`, the nearer winning. Hidden files and folders are never searched (a cache folder, say)."""
    root = root.expanduser().resolve()
    if not root.is_dir():
        raise ConfigError("data.path", f"{root} is not a folder", "data.path=/path/to/your/images")
    rules = _repeat_rules(root, repeats or {})
    out = ScanResult()
    images: list[Path] = []
    masks: set[Path] = set()
    metadata: dict[Path, tuple[str, Path]] = {}  # image -> (caption, the jsonl that gave it)

    def unreadable_folder(exc: OSError) -> None:
        out.problems.append(f"unreadable folder {exc.filename}: {exc.strerror}")

    for folder, dirs, files in os.walk(root, onerror=unreadable_folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # sorted: a deterministic order
        here = Path(folder)
        for name in sorted(f for f in files if not f.startswith(".")):
            suffix = Path(name).suffix.lower()
            if name.lower().endswith(MASK_SUFFIX):  # a mask, never an image: matched to its image below
                masks.add(here / name)
            elif suffix in IMAGE_SUFFIXES:
                images.append(here / name)
            elif name == METADATA:
                _read_metadata(here / name, root, metadata, out.problems)
            elif suffix != ".txt":
                out.other_files += 1
    for path in images:
        rel = path.relative_to(root).as_posix()
        size = _display_size(path)
        if isinstance(size, str):
            out.skipped.append(Skipped(rel, size))
            log.warning("skipping %s: %s", rel, size)
            continue
        caption, source = _caption(path, metadata, out.problems)
        beside = path.with_name(path.stem + MASK_SUFFIX)
        out.records.append(ImageRecord(path, rel, size[0], size[1], caption, source, _repeats_for(rel, rules),
                                       beside if beside in masks else None))
    matched = {r.mask for r in out.records if r.mask is not None}
    out.masks = len(matched)
    for path in sorted(masks - matched):
        out.problems.append(f"{_rel(path, root)}: a mask beside no jpg, png or webp image of its name")
    for path in sorted(set(metadata) - set(images)):
        out.problems.append(f"{_rel(metadata[path][1], root)}: {_rel(path, root)} is not a jpg, png or webp "
                            "file in the folder")
    return out


def _display_size(path: Path) -> tuple[int, int] | str:
    """(width, height) from the file header, or why the file cannot be used. Decodes no pixels."""
    try:
        with Image.open(path) as img:
            w, h = img.size
            orientation = img.getexif().get(0x0112, 1)
    except Exception as exc:  # a bad file raises almost anything: OSError, SyntaxError, struct.error...
        return f"unreadable image ({type(exc).__name__}: {exc})"
    if w <= 0 or h <= 0:
        return f"empty image ({w}x{h})"
    return (h, w) if orientation in _SWAPS_SIDES else (w, h)


def _caption(path: Path, metadata: Mapping[Path, tuple[str, Path]], problems: list[str]) -> tuple[str, str]:
    sidecar = path.with_suffix(".txt")
    if sidecar.is_file():
        try:
            return sidecar.read_text(encoding="utf-8", errors="replace").strip(), "sidecar"
        except OSError as exc:
            problems.append(f"unreadable caption {sidecar.name}: {exc}")
    if path in metadata:
        return metadata[path][0], "metadata"
    return "", "missing"


def _read_metadata(file: Path, root: Path, out: dict[Path, tuple[str, Path]], problems: list[str]) -> None:
    rel = _rel(file, root)
    try:
        lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        problems.append(f"{rel}: unreadable ({exc})")
        return
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name, caption = row["file_name"], row["caption"]
            if not isinstance(name, str) or not isinstance(caption, str):
                raise TypeError("file_name and caption must be strings")
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{rel} line {n}: {type(exc).__name__}: {exc}")
            continue
        image = Path(os.path.normpath(file.parent / name))  # no resolve(): a symlinked image keeps its name
        # A nearer metadata.jsonl wins: os.walk visits parents first, so a later entry is nearer.
        previous = out.get(image)
        if previous is None or len(previous[1].parts) <= len(file.parts):
            out[image] = (caption.strip(), file)


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def _repeat_rules(root: Path, repeats: Mapping[str, int]) -> list[tuple[PurePosixPath, int]]:
    rules = []
    for key, value in repeats.items():
        sub = PurePosixPath(str(key).strip("/"))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"data.repeats.{key}", f"must be a positive integer, got {value!r}",
                              f"data.repeats={{{key}:2}}")
        if not (root / sub).is_dir():
            raise ConfigError(f"data.repeats.{key}", f"{root / sub} is not a folder under data.path",
                              "name subfolders relative to data.path, e.g. data.repeats={dogs:3}")
        rules.append((sub, value))
    # Deepest folder first: a rule for dogs/puppies overrides one for dogs.
    return sorted(rules, key=lambda r: len(r[0].parts), reverse=True)


def _repeats_for(rel: str, rules: list[tuple[PurePosixPath, int]]) -> int:
    path = PurePosixPath(rel)
    for sub, n in rules:
        if sub in path.parents:
            return n
    return 1


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


def has_alpha(path: Path) -> bool:
    """Whether the image has an alpha channel (or a transparent palette entry), from its header."""
    with Image.open(path) as img:
        return img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info


def open_mask(record: ImageRecord) -> Image.Image | None:
    """The image's loss mask as 8-bit grey ("L"), upright: its <stem>.mask.png, else its own alpha channel; None
    when it has neither (every pixel trains)."""
    if record.mask is not None:
        with Image.open(record.mask) as decoded:
            decoded.load()
            return ImageOps.exif_transpose(decoded).convert("L")
    if not has_alpha(record.path):
        return None
    with Image.open(record.path) as decoded:
        decoded.load()
        return ImageOps.exif_transpose(decoded).convert("RGBA").getchannel("A")


def _bucket_crop(img: Image.Image, placement: Placement, resample: Image.Resampling) -> np.ndarray:
    """The image resized to cover its bucket and cropped to it, as uint8 [h, w(, channels)]."""
    if img.size != (placement.orig_w, placement.orig_h):
        raise ValueError(f"{img.size[0]}x{img.size[1]} px differs from the image header's "
                         f"{placement.orig_w}x{placement.orig_h}")
    resized = img.resize((placement.resized_w, placement.resized_h), resample)
    bw, bh = placement.bucket
    crop = resized.crop((placement.crop_left, placement.crop_top, placement.crop_left + bw, placement.crop_top + bh))
    return np.asarray(crop, dtype=np.uint8).copy()


def crop_mask(mask: Image.Image, placement: Placement, flipped: bool, factor: int) -> torch.Tensor:
    """The mask cropped as crop_pixels crops its image (mirrored for the flipped view), averaged over each
    latent pixel's `factor` x `factor` pixels (area, as kohya's masked loss): [1, h / factor, w / factor] in [0, 1]."""
    values = torch.from_numpy(_bucket_crop(mask, placement, Image.Resampling.BILINEAR)).float()[None, None] / 255.0
    if flipped:
        values = values.flip(-1)
    bw, bh = placement.bucket
    return F.interpolate(values, size=(bh // factor, bw // factor), mode="area")[0]


def crop_pixels(img: Image.Image, placement: Placement) -> torch.Tensor:
    """The bucket crop as a float tensor [3, h, w] in [-1, 1]."""
    pixels = torch.from_numpy(_bucket_crop(img, placement, Image.Resampling.LANCZOS)).permute(2, 0, 1)
    return pixels.float() / 127.5 - 1.0

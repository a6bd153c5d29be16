"""Find the images of a folder, their captions and their repeat counts; decode nothing.

Captions come from a side-car `<stem>.txt` beside the image, else from a `metadata.jsonl` (lines of
{"file_name": ..., "caption": ...}, file_name relative to the jsonl's folder) in the image's folder or
any folder above it inside data.path; a side-car wins over metadata, a nearer metadata.jsonl over a
farther one. Hidden files and folders (a leading ".") are never searched: that keeps a cache folder
inside data.path out of the scan.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from PIL import Image

from zerotune.errors import ConfigError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
METADATA = "metadata.jsonl"
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


def scan_folder(root: Path, repeats: Mapping[str, int] | None = None) -> ScanResult:
    """Every supported image under `root`, with its caption, display size and repeat count."""
    root = root.expanduser().resolve()
    if not root.is_dir():
        raise ConfigError("data.path", f"{root} is not a folder", "data.path=/path/to/your/images")
    rules = _repeat_rules(root, repeats or {})
    out = ScanResult()
    images: list[Path] = []
    metadata: dict[Path, tuple[str, Path]] = {}  # image -> (caption, the jsonl that gave it)

    def unreadable_folder(exc: OSError) -> None:
        out.problems.append(f"unreadable folder {exc.filename}: {exc.strerror}")

    for folder, dirs, files in os.walk(root, onerror=unreadable_folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # sorted: a deterministic order
        here = Path(folder)
        for name in sorted(f for f in files if not f.startswith(".")):
            suffix = Path(name).suffix.lower()
            if suffix in IMAGE_SUFFIXES:
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
        out.records.append(ImageRecord(path, rel, size[0], size[1], caption, source, _repeats_for(rel, rules)))
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


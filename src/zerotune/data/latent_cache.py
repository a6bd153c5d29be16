"""VAE latents and text embeddings on disk, one safetensors file per entry named by a hash of all its value depends
on (so a change recomputes only what it touches), written whole and never evicted; the training items read back from
it; and file hashes remembered by (path, size, mtime), as rehashing a 10 GB encoder each run would cost minutes."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from zerotune.config.files import replaced, write_text_atomic
from zerotune.data.buckets import Bucket, Placement, Ref, SampleRef
from zerotune.data.sources import (
    DECODE_ERRORS,
    ImageRecord,
    Skipped,
    crop_mask,
    crop_pixels,
    open_mask,
    open_rgb,
)


def digest(*parts: object) -> str:
    """A stable hex key for JSON-able parts (dict keys are sorted)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class FileHasher:
    def __init__(self, index_file: Path | None):
        self.index_file = index_file
        self._index: dict[str, list] = {}
        self._dirty = False
        if index_file is not None and index_file.is_file():
            try:
                self._index = json.loads(index_file.read_text())
            except ValueError:
                self._index = {}  # a damaged index only costs rehashing

    def file(self, path: Path) -> str:
        path = path.resolve()
        st = path.stat()
        key = str(path)
        hit = self._index.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        with open(path, "rb") as f:
            value = hashlib.file_digest(f, "sha256").hexdigest()
        self._index[key] = [st.st_size, st.st_mtime_ns, value]
        self._dirty = True
        return value

    def folder(self, folder: Path) -> str:
        """One hash of every file in a folder (hidden ones aside), names included."""
        folder = folder.resolve()
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        return digest([(name, self.file(folder / name)) for name in files])

    def save(self) -> None:
        if self.index_file is None or not self._dirty:
            return
        self.index_file.parent.mkdir(parents=True, exist_ok=True)
        # Runs of a sweep may save at once: each writes a whole file and renames it, the last one wins.
        write_text_atomic(self.index_file, json.dumps(self._index))
        self._dirty = False


log = logging.getLogger(__name__)

# Bump when the preprocessing changes (resize filter, crop rule, pixel range): every latent is stale then.
PREPROCESS_VERSION = 1


class LatentCache:
    def __init__(self, root: Path):
        self.root = root

    @staticmethod
    def latent_key(image_hash: str, vae_id: str, placement: Placement, flipped: bool) -> str:
        geometry = [placement.resized_w, placement.resized_h, placement.crop_left, placement.crop_top]
        return digest("latent", PREPROCESS_VERSION, image_hash, vae_id, list(placement.bucket), geometry, flipped)

    @staticmethod
    def mask_key(source_hash: str, placement: Placement, flipped: bool, factor: int) -> str:
        """`source_hash`: the mask file's bytes, or the image's for its alpha channel."""
        geometry = [placement.resized_w, placement.resized_h, placement.crop_left, placement.crop_top]
        return digest("mask", PREPROCESS_VERSION, source_hash, list(placement.bucket), geometry, flipped, factor)

    @staticmethod
    def text_key(caption: str, text_id: str, seq_len: int) -> str:
        return digest("text", caption, text_id, seq_len)

    def _path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        return self._path(kind, key).is_file()

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        path = self._path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)

    def size_bytes(self, kind: str, keys: set[str]) -> int:
        """The bytes on disk of these entries (a shared cache holds other data sets' too)."""
        return sum(self._path(kind, key).stat().st_size for key in keys)

    def get(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        return load_file(str(self._path(kind, key)))

    def put_text(self, key: str, hidden: torch.Tensor, pooled: torch.Tensor | None, caption: str) -> None:
        """A caption's (or validation prompt's) embeddings, as FrozenEncoders.encode_text gives them (no pooled
        embedding for SD 1.x / 2.x)."""
        tensors = {"encoder_hidden_states": hidden} if pooled is None else {"encoder_hidden_states": hidden,
                                                                              "text_embeds": pooled}
        self.put("text", key, tensors, {"caption": caption})

    def put_texts(self, keys: list[str], captions: list[str], hidden: torch.Tensor,
                  pooled: torch.Tensor | None) -> None:
        """One encode_text batch's entries: row i is captions[i]'s, under keys[i]."""
        for i, (key, caption) in enumerate(zip(keys, captions, strict=True)):
            self.put_text(key, hidden[i], None if pooled is None else pooled[i], caption)

    def get_text(self, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [seq, d], pooled [p] or None) as put_text stored them."""
        entry = self.get("text", key)
        return entry["encoder_hidden_states"], entry.get("text_embeds")


@dataclass
class CacheItem:
    """One image to cache: where it lands, which views it needs, and its entries' keys."""
    record: ImageRecord
    placement: Placement
    latent_keys: dict[bool, str]  # flipped -> key; {False: ...} alone without random_flip
    text_keys: tuple[str, ...]    # one per caption variant (data/captions.py); the caption's alone without
    texts: tuple[str, ...]        # the variants' texts
    mask_keys: dict[bool, str] | None = None  # flipped -> key, under data.masked_loss for an image with a mask

    def text_entries(self) -> dict[str, str]:
        """{text entry key: its text}, one per caption variant."""
        return dict(zip(self.text_keys, self.texts, strict=True))


@dataclass
class CacheStats:
    latents_computed: int = 0
    latents_reused: int = 0
    texts_computed: int = 0
    texts_reused: int = 0
    images_encoded: int = 0
    latent_seconds: float = 0.0
    text_seconds: float = 0.0
    failed: list[Skipped] = field(default_factory=list)

    def as_dict(self) -> dict:
        rate = self.images_encoded / self.latent_seconds if self.images_encoded else None
        return {"latents_computed": self.latents_computed, "latents_reused": self.latents_reused,
                "texts_computed": self.texts_computed, "texts_reused": self.texts_reused,
                "images_encoded": self.images_encoded, "latent_seconds": round(self.latent_seconds, 3),
                "text_seconds": round(self.text_seconds, 3), "images_per_s": rate}


class Encoders(Protocol):
    """What build_cache needs; data.components.FrozenEncoders is the real one."""

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


def build_cache(items: list[CacheItem], cache: LatentCache, encoders: Encoders, batch_size: int,
                progress: bool = True, extra_texts: dict[str, str] | None = None,
                mask_factor: int | None = None) -> tuple[list[CacheItem], CacheStats]:
    """Compute every missing entry; returns the items whose entries all exist, and what it did. `extra_texts`:
    {key: text} cached beside the items' (the empty caption of caption_dropout); `mask_factor`: the VAE's, under
    data.masked_loss (masks are cached at the latents' resolution).

    An image that fails to decode is skipped (warned, listed in stats.failed), never fatal.
    """
    stats = CacheStats()
    ok = _build_latents(items, cache, encoders, batch_size, progress, stats)
    if mask_factor is not None:
        ok = _build_masks(ok, cache, mask_factor, stats)
    _build_texts(ok, cache, encoders, batch_size, progress, stats, extra_texts or {})
    return ok, stats


def _build_masks(items: list[CacheItem], cache: LatentCache, factor: int, stats: CacheStats) -> list[CacheItem]:
    """Each masked image's mask at the latents' resolution, per view; an unreadable mask skips its image."""
    failed: set[int] = set()
    for it in items:
        missing = {f: k for f, k in (it.mask_keys or {}).items() if not cache.has("masks", k)}
        if not missing:
            continue
        try:
            mask = open_mask(it.record)
            assert mask is not None, "a mask key without a mask"
            for flipped, key in missing.items():
                cache.put("masks", key, {"mask": crop_mask(mask, it.placement, flipped, factor)},
                          {"image": it.record.rel, "flipped": str(flipped)})
        except (*DECODE_ERRORS, ValueError) as exc:
            reason = f"unreadable mask ({type(exc).__name__}: {exc})"
            log.warning("skipping %s: %s", it.record.rel, reason)
            stats.failed.append(Skipped(it.record.rel, reason))
            failed.add(id(it))
    return [it for it in items if id(it) not in failed]


def _build_latents(items: list[CacheItem], cache: LatentCache, encoders: Encoders, batch_size: int,
                   progress: bool, stats: CacheStats) -> list[CacheItem]:
    keys = {k for it in items for k in it.latent_keys.values()}
    missing = {k for k in keys if not cache.has("latents", k)}
    stats.latents_reused = len(keys) - len(missing)
    todo = [it for it in items if any(k in missing for k in it.latent_keys.values())]
    failed: set[int] = set()
    start = time.perf_counter()
    by_bucket: dict[tuple[int, int], list[CacheItem]] = {}
    for it in todo:
        by_bucket.setdefault(it.placement.bucket, []).append(it)
    with tqdm(total=len(todo), desc="caching latents", unit="img", disable=not progress or not todo) as bar:
        for group in by_bucket.values():
            for i in range(0, len(group), batch_size):
                chunk = group[i:i + batch_size]
                views: list[tuple[CacheItem, bool, torch.Tensor]] = []
                for it in chunk:
                    try:
                        pixels = crop_pixels(open_rgb(it.record.path), it.placement)
                    except DECODE_ERRORS as exc:
                        reason = f"corrupt image ({type(exc).__name__}: {exc})"
                        log.warning("skipping %s: %s", it.record.rel, reason)
                        stats.failed.append(Skipped(it.record.rel, reason))
                        failed.add(id(it))
                        continue
                    stats.images_encoded += 1
                    for flipped, key in it.latent_keys.items():
                        if key in missing:  # once only, also for two identical files
                            missing.discard(key)
                            views.append((it, flipped, pixels.flip(-1) if flipped else pixels))
                if views:
                    latents = encoders.encode_images(torch.stack([v[2] for v in views]))
                    for (it, flipped, _), z in zip(views, latents, strict=True):
                        cache.put("latents", it.latent_keys[flipped], {"latents": z},
                                  {"image": it.record.rel, "flipped": str(flipped)})
                    stats.latents_computed += len(views)
                bar.update(len(chunk))
    stats.latent_seconds = time.perf_counter() - start
    return [it for it in items if id(it) not in failed]


def _build_texts(items: list[CacheItem], cache: LatentCache, encoders: Encoders, batch_size: int,
                 progress: bool, stats: CacheStats, extra: dict[str, str]) -> None:
    captions = {**{k: t for it in items for k, t in it.text_entries().items()}, **extra}
    todo = [(k, c) for k, c in captions.items() if not cache.has("text", k)]
    stats.texts_reused = len(captions) - len(todo)
    start = time.perf_counter()
    with tqdm(total=len(todo), desc="caching text embeddings", unit="caption",
              disable=not progress or not todo) as bar:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i:i + batch_size]
            texts = [c for _, c in chunk]
            cache.put_texts([k for k, _ in chunk], texts, *encoders.encode_text(texts))
            stats.texts_computed += len(chunk)
            bar.update(len(chunk))
    stats.text_seconds = time.perf_counter() - start


class CachedFolderDataset(Dataset):
    """One sample per image and repeat; index with an int, (int, flipped) under random_flip, or a buckets.Ref
    (its caption variant, or the empty caption)."""

    def __init__(self, cache: LatentCache, items: list[CacheItem], conditioning: str,
                 tokens: dict[str, torch.Tensor] | None = None, empty_key: str | None = None, masked: bool = False):
        """`conditioning`: the model's (text, text_time, text_pooled); `tokens`: {key: [len(texts), seq]} per trained
        text encoder, a row per text of text_rows(); `empty_key`: the empty caption's entry (caption_dropout);
        `masked`: each sample carries its loss mask (data.masked_loss; ones for an image without one)."""
        self.cache, self.items, self.tokens, self.conditioning = cache, items, tokens or {}, conditioning
        self.empty_key, self.masked = empty_key, masked
        # A repeated image is several samples that read the same entries.
        self._item_of = [i for i, it in enumerate(items) for _ in range(it.record.repeats)]
        self.buckets: list[Bucket] = [items[i].placement.bucket for i in self._item_of]
        self._row = {key: row for row, key in enumerate(text_rows(items, empty_key))}
        self.report: dict = {}  # filled by prepare_folder_data, for the run's summary

    def __len__(self) -> int:
        return len(self._item_of)

    def __getitem__(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        drawn = Ref(ref) if isinstance(ref, int) else Ref(*ref)
        i = self._item_of[drawn.sample]
        item = self.items[i]
        text_key = item.text_keys[drawn.variant]
        if drawn.dropped:
            assert self.empty_key is not None, "a dropped caption without data.caption_dropout's empty entry"
            text_key = self.empty_key
        hidden, pooled = self.cache.get_text(text_key)
        sample = {"x0": self.cache.get("latents", item.latent_keys[drawn.flipped])["latents"],
                  "encoder_hidden_states": hidden}
        if self.conditioning == "text_pooled":  # FLUX.1, SD3: the pooled embedding, no time ids
            sample["pooled_projections"] = pooled
        elif pooled is not None:  # SDXL: the added conditioning
            sample.update(text_embeds=pooled, time_ids=torch.tensor(item.placement.time_ids(drawn.flipped)))
        sample.update({key: ids[self._row[text_key]] for key, ids in self.tokens.items()})
        if self.masked:
            keys = item.mask_keys
            sample["mask"] = self.cache.get("masks", keys[drawn.flipped])["mask"] if keys else \
                torch.ones(1, *sample["x0"].shape[1:])
        return sample


def text_rows(items: list[CacheItem], empty_key: str | None = None) -> list[str]:
    """Every text entry the items read, each once, in a fixed order: the rows of the trained encoders' tokens."""
    keys = [k for it in items for k in it.text_keys]
    return list(dict.fromkeys([*keys, *([empty_key] if empty_key else [])]))

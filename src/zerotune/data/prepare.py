"""data=folder from config to DataLoader: check (in seconds, before anything loads), scan, bucket, cache, report."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from zerotune.config.errors import ConfigError
from zerotune.config.files import write_cached_json
from zerotune.data import captions
from zerotune.data.buckets import (
    Bucket,
    BucketBatchSampler,
    Placement,
    batches_per_bucket,
    bucket_name,
    closest_bucket,
    make_buckets,
    place,
)
from zerotune.data.captions import CaptionRules
from zerotune.data.components import (
    ComponentPaths,
    FrozenEncoders,
    check_bucket_step,
    check_compatible,
    component_ids,
    resolve_components,
    tokenize,
)
from zerotune.data.latent_cache import (
    CachedFolderDataset,
    CacheItem,
    FileHasher,
    LatentCache,
    build_cache,
    digest,
    text_rows,
)
from zerotune.data.sources import ImageRecord, ScanResult, Skipped, has_alpha, scan_folder
from zerotune.data.spec import DataSpec
from zerotune.models import text_encoders
from zerotune.models.backbones import backbone_of

log = logging.getLogger(__name__)

REPORT_FILE = "data_report.json"


@dataclass
class CheckedFolder:
    root: Path
    scan: ScanResult
    placed: list[tuple[ImageRecord, Placement]]
    too_small: list[Skipped]
    components: ComponentPaths


def cache_dir(spec: DataSpec) -> Path:
    """data.cache_dir, else one per user, shared by every run and data set: entries are keyed by content."""
    configured = spec.data.cache_dir
    if configured:
        return Path(str(configured)).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "zerotune" / "latents"


def check_folder_data(spec: DataSpec) -> CheckedFolder:
    """Every check of data=folder that loads no model and decodes no pixels."""
    if spec.model.conditioning == "class":
        raise ConfigError("data", f"data=folder makes text conditioning; model={spec.model.name} "
                          "is conditioned on class labels", "model=sdxl, sd15, sd21, flux or sd35_large with data=folder")
    if not spec.data.path:
        raise ConfigError("data.path", "no image folder given", "data.path=/path/to/your/images")
    captions.check(spec.data)
    step = spec.data.bucket_step
    check_bucket_step(spec.model, step)
    size = spec.resolution
    if size < step:
        raise ConfigError("resolution.size", f"{size} px is below the smallest bucket side ({step})",
                          f"resolution.size={step * 2} or more")
    root = Path(str(spec.data.path)).expanduser().resolve()
    scan = scan_folder(root, dict(spec.data.repeats or {}))
    if not scan.records:
        found = (f"its {len(scan.skipped)} jpg, png and webp files are all unreadable" if scan.skipped else
                 "no jpg, png or webp file in it or its subfolders (hidden ones are not searched)")
        raise ConfigError("data.path", f"no usable image in {root}: {found}",
                          "data.path=a folder of images, with captions in side-car .txt files or metadata.jsonl")
    buckets = make_buckets(size, step, spec.data.bucket_max_ratio)
    placed, too_small = [], []
    for record in scan.records:
        placement = place(record.width, record.height, closest_bucket(record.width, record.height, buckets))
        if placement.upscales and not spec.data.upscale_small:
            too_small.append(Skipped(record.rel, f"{record.width}x{record.height} px is smaller than its bucket "
                                     f"{bucket_name(placement.bucket)} (data.upscale_small=true upscales it)"))
        else:
            placed.append((record, placement))
    if not placed:
        raise ConfigError("data.path", f"all {len(too_small)} readable images in {root} are smaller than their "
                          f"bucket at resolution.size={size}", "data.upscale_small=true, or a smaller resolution.size")
    _check_batches([p.bucket for r, p in placed for _ in range(r.repeats)], spec.batch_size)
    components = resolve_components(spec.model)
    check_compatible(spec.model, components)
    return CheckedFolder(root, scan, placed, too_small, components)


def prepare_folder_data(spec: DataSpec, run_dir: str | Path | None = None, micro_batch: int | None = None,
                        device: torch.device | None = None,
                        progress: bool = True) -> tuple[CachedFolderDataset, dict]:
    """The cached dataset and its report; writes <run_dir>/data_report.json when run_dir is given. Encoders load
    only if some entry is missing, on `device` (default: data.cache_device), and are released before it returns."""
    folder = check_folder_data(spec)
    micro_batch = int(micro_batch or spec.batch_size)
    cache = LatentCache(cache_dir(spec))
    seq_len = int(spec.model.text_seq_len)
    rules = CaptionRules.of(spec.data)
    items, unreadable, text_id = _cache_items(spec, folder, cache, seq_len, rules)
    empty = {LatentCache.text_key("", text_id, seq_len): ""} if rules.dropout > 0 else {}
    encoders = FrozenEncoders(folder.components, device or _device(spec), spec.model)
    try:
        ok, stats = build_cache(items, cache, encoders, spec.data.cache_batch_size, progress, empty,
                                int(spec.model.vae_scale_factor) if spec.data.masked_loss else None)
    finally:
        encoders.release()
    if not ok:
        raise ConfigError("data.path", f"none of the {len(folder.placed)} images in {folder.root} that fit a bucket "
                          "could be read and decoded", "data.path=a folder of valid jpg, png or webp images")
    trained = text_encoders.trained(spec.model)
    empty_key = next(iter(empty), None)
    texts = {k: t for it in ok for k, t in it.text_entries().items()} | empty
    tokens = tokenize(folder.components, trained, [texts[k] for k in text_rows(ok, empty_key)], seq_len) \
        if trained else None
    dataset = CachedFolderDataset(cache, ok, str(spec.model.conditioning), tokens, empty_key,
                                  masked=bool(spec.data.masked_loss))
    _check_batches(dataset.buckets, micro_batch)  # again: images that failed to decode are gone
    full = _report(spec, folder, cache, dataset, [*folder.scan.skipped, *unreadable, *stats.failed], stats.as_dict(),
                   micro_batch)
    for name, b in full["buckets"].items():
        if not b["batches_per_epoch"]:
            log.warning("bucket %s has %d samples, fewer than a batch of %d: they are never trained on",
                        name, b["samples"], micro_batch)
    if run_dir is not None:
        full["report_file"] = str(Path(run_dir) / REPORT_FILE)
        write_cached_json(Path(run_dir) / REPORT_FILE, full)
    dataset.report = {k: v for k, v in full.items() if k not in _LISTS}
    _log_summary(dataset.report)
    return dataset, dataset.report


def _cache_items(spec: DataSpec, folder: CheckedFolder, cache: LatentCache, seq_len: int,
                 rules: CaptionRules) -> tuple[list[CacheItem], list[Skipped], str]:
    """Each placed image's cache keys (its content, the components, crop and flip; its caption's variants), what
    was unreadable, and the text encoders' id."""
    hasher = FileHasher(cache.root / "file_hashes.json")
    ids = component_ids(folder.components, hasher)
    flips = (False, True) if spec.data.random_flip else (False,)
    items, unreadable = [], []
    for record, placement in folder.placed:
        try:
            image_hash = hasher.file(record.path)
        except OSError as exc:
            unreadable.append(Skipped(record.rel, f"unreadable file ({exc})"))
            continue
        texts = rules.texts(record.caption)
        items.append(CacheItem(record, placement,
                               {f: LatentCache.latent_key(image_hash, ids["vae"], placement, f) for f in flips},
                               tuple(LatentCache.text_key(t, ids["text"], seq_len) for t in texts), texts,
                               _mask_keys(spec, record, placement, flips, image_hash, hasher)))
    hasher.save()
    return items, unreadable, ids["text"]


def _mask_keys(spec: DataSpec, record: ImageRecord, placement: Placement, flips: tuple[bool, ...], image_hash: str,
               hasher: FileHasher) -> dict[bool, str] | None:
    """Under data.masked_loss, the keys of the image's mask per view: its <stem>.mask.png's, or its alpha
    channel's (read from the header alone); None when it has neither."""
    if not spec.data.masked_loss:
        return None
    if record.mask is not None:
        source = hasher.file(record.mask)
    elif has_alpha(record.path):
        source = digest("alpha", image_hash)
    else:
        return None
    factor = int(spec.model.vae_scale_factor)
    return {f: LatentCache.mask_key(source, placement, f, factor) for f in flips}


def folder_loader(spec: DataSpec, micro_batch: int, seed: int, run_dir: str | Path | None = None) -> DataLoader:
    """The training DataLoader of data=folder; with several processes, each node's first fills the cache
    while the others wait, then finds every entry there (a shared cache_dir is filled once)."""
    from accelerate import PartialState

    state = PartialState()
    device = state.device if spec.data.cache_device == "auto" else None  # None: data.cache_device
    with state.local_main_process_first():
        dataset, _ = prepare_folder_data(spec, run_dir if state.is_main_process else None, micro_batch, device,
                                         progress=state.is_local_main_process)
    rules = CaptionRules.of(spec.data)
    sampler = BucketBatchSampler(dataset.buckets, micro_batch, seed, random_flip=spec.data.random_flip,
                                 caption_variants=rules.variants, caption_dropout=rules.dropout)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=spec.data.num_workers)


# Per-file lists go to data_report.json only; summary.json gets the counts.
_LISTS = ("skipped_files", "missing_captions", "upscaled_files", "problem_list")


def _report(spec: DataSpec, folder: CheckedFolder, cache: LatentCache, dataset: CachedFolderDataset,
            skipped: list[Skipped], cache_stats: dict, micro_batch: int) -> dict:
    used = [it.record for it in dataset.items]
    sources = Counter(r.caption_source for r in used)
    upscaled = [it.record.rel for it in dataset.items if it.placement.upscales]
    return {
        "path": str(folder.root), "cache_dir": str(cache.root),
        "images_found": len(folder.scan.records) + len(folder.scan.skipped), "images_used": len(used),
        "samples_per_epoch": len(dataset),
        "skipped": {"unreadable": len(skipped), "too_small": len(folder.too_small)},
        "upscaled": len(upscaled),
        "masks": _masks(spec, dataset),
        "captions": {"sidecar": sources["sidecar"], "metadata": sources["metadata"],
                     "missing": sources["missing"]},
        "caption_rules": _caption_rules(spec, dataset),
        "problems": len(folder.scan.problems), "other_files": folder.scan.other_files,
        "random_flip": spec.data.random_flip, "micro_batch": micro_batch,
        "buckets": batches_per_bucket(dataset.buckets, micro_batch),
        "cache": cache_stats,
        # what this data set's entries take on disk: T5's states are most of it (FLUX.1: 8 MiB a caption in fp32)
        "cache_mib": {"latents": round(cache.size_bytes("latents", {k for it in dataset.items
                                                                    for k in it.latent_keys.values()}) / 2**20, 3),
                      "text": round(cache.size_bytes("text", set(text_rows(dataset.items, dataset.empty_key)))
                                    / 2**20, 3)},
        # a trained encoder's condition is computed from the tokens at every step: its embeddings are not used
        "text_conditioning": _text_conditioning(spec),
        "skipped_files": [{"file": s.rel, "reason": s.reason} for s in [*skipped, *folder.too_small]],
        "missing_captions": [r.rel for r in used if r.caption_source == "missing"],
        "upscaled_files": upscaled,
        "problem_list": folder.scan.problems,
    }


def _masks(spec: DataSpec, dataset: CachedFolderDataset) -> dict:
    """data.masked_loss: how many used images train under a mask file, their alpha channel, or none."""
    if not spec.data.masked_loss:
        return {"masked_loss": False}
    files = sum(1 for it in dataset.items if it.mask_keys and it.record.mask is not None)
    alpha = sum(1 for it in dataset.items if it.mask_keys and it.record.mask is None)
    return {"masked_loss": True, "mask_files": files, "alpha_channels": alpha,
            "unmasked": len(dataset.items) - files - alpha}


def _caption_rules(spec: DataSpec, dataset: CachedFolderDataset) -> dict:
    rules = CaptionRules.of(spec.data)
    return {"shuffle_tags": rules.shuffle, "keep_tags": rules.keep, "variants_per_caption": rules.variants,
            "caption_dropout": rules.dropout, "text_entries": len(text_rows(dataset.items, dataset.empty_key))}


def _text_conditioning(spec: DataSpec) -> dict:
    """What the cache gives each text encoder: a trained one computes its part from the captions' tokens at every
    step (its cached embeddings go unused); a frozen one's part is its cached embeddings."""
    trained = text_encoders.trained(spec.model)
    encoders = [n for n in backbone_of(spec.model).components() if n.startswith("text_encoder")]
    return {name: "tokens (trained)" if name in trained else "embeddings" for name in encoders}


def _check_batches(buckets: list[Bucket], micro_batch: int) -> None:
    fullest = max(Counter(buckets).values(), default=0)
    if fullest < micro_batch:
        raise ConfigError("train.batch_size", f"no bucket holds a whole batch of {micro_batch} samples (the "
                          f"fullest has {fullest}); batches never mix buckets",
                          f"train.batch_size={max(fullest, 1)} or less, more images, or data.repeats")


def _device(spec: DataSpec) -> torch.device:
    choice = spec.data.cache_device
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def _log_summary(r: dict) -> None:
    log.info("data=folder: %d of %d images used (%d unreadable, %d too small, %d upscaled), %d without caption, "
             "%d buckets; cache: %d latents and %d text entries computed, %d and %d reused, %.1f MiB of latents "
             "and %.1f MiB of text on disk",
             r["images_used"], r["images_found"], r["skipped"]["unreadable"], r["skipped"]["too_small"],
             r["upscaled"], r["captions"]["missing"], len(r["buckets"]), r["cache"]["latents_computed"],
             r["cache"]["texts_computed"], r["cache"]["latents_reused"], r["cache"]["texts_reused"],
             r["cache_mib"]["latents"], r["cache_mib"]["text"])
    if r["captions"]["missing"]:
        log.warning("%d images have no caption (no side-car .txt, no metadata.jsonl entry): trained with an "
                    "empty caption; listed in %s", r["captions"]["missing"], REPORT_FILE)

"""Data sets by name (spec.data.name), each loading its own module on demand (scikit-learn, PIL and the latent cache
are heavy; items are dicts: "x0" plus conditioning), and the data checks run before any worker starts."""

from __future__ import annotations

import math
from pathlib import Path

import psutil
import torch
from torch.utils.data import DataLoader, Dataset

from zerotune.config.errors import ConfigError
from zerotune.config.schema import DTYPE_BYTES
from zerotune.data.spec import DataSpec
from zerotune.models import downsample_factor, latent_shape, text_encoders

DIGITS_IMAGES = 1797   # sklearn's digits: DigitsDataset holds every one, upsampled, in one tensor
GIB = 2**30


def input_bytes(spec: DataSpec) -> tuple[int, str]:
    """The bytes of input that must sit in memory at once, and what they are, in words."""
    channels, height, width = latent_shape(spec.model, spec.resolution)
    sample = channels * height * width * DTYPE_BYTES["fp32"]  # samples are float32 tensors
    each = f"{channels}x{height}x{width} float32, {sample / GIB:,.2f} GiB each"
    if spec.data.name == "digits":
        return DIGITS_IMAGES * sample, f"data=digits holds its {DIGITS_IMAGES} images upsampled ({each})"
    return spec.batch_size * sample, f"one micro batch of {spec.batch_size} inputs ({each})"


def check_fits_memory(spec: DataSpec, total: int | None = None) -> None:
    """Refuse a resolution whose input tensors alone exceed this machine's memory (`total` bytes; default:
    psutil's total). A lower bound: activations, weights and optimizer states come on top."""
    total = total or psutil.virtual_memory().total
    need, what = input_bytes(spec)
    if need <= total:
        return
    # Input bytes grow with size**2: the largest size that fits, rounded down to one the model takes.
    step = int(spec.model.vae_scale_factor) * downsample_factor(spec.model)
    largest = int(spec.resolution * math.sqrt(total / need)) // step * step
    fix = f"resolution.size={largest} or less" if largest > 0 else "a smaller model or resolution"
    if spec.data.name != "digits":
        fix += ", or a smaller train.batch_size"
    raise ConfigError("resolution.size", f"{spec.resolution} px needs at least {need / GIB:,.1f} GiB of memory "
                      f"for its inputs alone: {what}; this machine has {total / GIB:,.1f} GiB in all "
                      "(psutil.virtual_memory().total)", fix)


def build_dataset(spec: DataSpec) -> Dataset:
    """The data set `spec` names, checked before (check_data, in the job's checks)."""
    name = spec.data.name
    if name == "digits":
        from zerotune.data.sources import DigitsDataset

        return DigitsDataset(size=spec.resolution, split="train", seed=spec.seed, invert=bool(spec.data.invert))
    if name == "synthetic":
        from zerotune.data.sources import SyntheticDataset

        return SyntheticDataset(spec, latent_shape(spec.model, spec.resolution))
    if name == "folder":
        from zerotune.data.prepare import prepare_folder_data

        return prepare_folder_data(spec)[0]
    raise ConfigError("data.name", f"unknown data set {name!r}", "data=digits, data=synthetic or data=folder")


def check_data(spec: DataSpec, training: bool = True) -> None:
    """The data checks that load no model (seconds): for the parent process, before workers start. `training`:
    False where only a plan is made (`zerotune plan model=sdxl` plans the default data's shapes, never reads it)."""
    check_invert(spec)
    if spec.data.name != "folder":  # data=folder checks its caption rules with the rest of the folder's
        from zerotune.data.captions import check as check_captions

        check_captions(spec.data)
    if text_encoders.trained(spec.model) and spec.data.name != "folder" and training:
        raise ConfigError("model.train_text_encoder", f"trains the text encoders on captions' tokens; data="
                          f"{spec.data.name} has no captions", "data=folder data.path=/path/to/captioned/images "
                          "model.components=/path/to/its/pipeline, or model.train_text_encoder=none")
    if spec.data.name == "digits" and training:
        check_digits(spec)
    check_fits_memory(spec)
    if spec.data.name == "folder":
        from zerotune.data.prepare import check_folder_data

        check_folder_data(spec)


def check_digits(spec: DataSpec) -> None:
    """The digits are 1-channel pixel images with class labels: only a class-conditional pixel model takes them."""
    model = spec.model
    if model.conditioning != "class" or int(model.vae_scale_factor) != 1 or latent_shape(model, spec.resolution)[0] != 1:
        text = model.conditioning != "class"
        raise ConfigError("data", f"digits are 1-channel pixel images with class labels; model={model.name} "
                          "does not take those", "data=synthetic (random inputs of its shapes)" + (
                              ", or data=folder data.path=/path/to/captioned/images model.components=/path/to/its/pipeline"
                              if text else "")
                          + ", or model=tiny with data=digits")


def check_invert(spec: DataSpec) -> None:
    """data.invert draws the digits inverted; no other data set has an ink and a paper to swap."""
    if spec.data.invert and spec.data.name != "digits":
        raise ConfigError("data.invert", f"inverts the digits (ink <-> paper); data={spec.data.name} has no "
                          "such images to invert", "data.invert=false, or data=digits data.invert=true")


def build_loader(spec: DataSpec, micro_batch: int, seed: int, run_dir: str | Path | None = None) -> DataLoader:
    """The training DataLoader: shuffled by a seeded generator, whole batches only. data=folder: batches from one
    aspect-ratio bucket each, read from the latent cache (filled first, by one process per node);
    `loader.dataset.report` is its data report, also written to <run_dir>/data_report.json when run_dir is given."""
    if spec.data.name == "folder":
        from zerotune.data.prepare import folder_loader

        return folder_loader(spec, micro_batch, seed, run_dir)
    return DataLoader(build_dataset(spec), batch_size=micro_batch, shuffle=True, drop_last=True,
                      num_workers=spec.data.num_workers, generator=torch.Generator().manual_seed(seed))

"""Data sets by name (spec.data.name); each loads its own module on demand (scikit-learn, PIL and the
latent cache are heavy, and a job needs one of them). Items are dicts: "x0" (the clean sample) plus conditioning."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from zerotune.data.footprint import check_fits_memory
from zerotune.data.spec import DataSpec
from zerotune.errors import ConfigError
from zerotune.models import latent_shape, text_encoders


def build_dataset(spec: DataSpec) -> Dataset:
    name, model = spec.data.name, spec.model
    check_invert(spec)
    shape = latent_shape(model, spec.resolution)
    if name == "digits":
        check_digits(spec)
        from zerotune.data.digits import DigitsDataset

        return DigitsDataset(size=spec.resolution, split="train", seed=spec.seed, invert=bool(spec.data.invert))
    if name == "synthetic":
        from zerotune.data.synthetic import SyntheticDataset

        return SyntheticDataset(spec, shape)
    if name == "folder":
        from zerotune.data.prepare import prepare_folder_data

        return prepare_folder_data(spec)[0]
    raise ConfigError("data.name", f"unknown data set {name!r}", "data=digits, data=synthetic or data=folder")


def check_data(spec: DataSpec, training: bool = True) -> None:
    """The data checks that load no model (seconds): for the parent process, before workers start. `training`:
    False where only a plan is made (`zerotune plan model=sdxl` plans the default data's shapes, never reads it)."""
    check_invert(spec)
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
    """The training DataLoader: shuffled by a seeded generator, whole batches only.

    data=folder: batches from one aspect-ratio bucket each, read from the latent cache (filled first, by
    one process per node); `loader.dataset.report` is its data report, also written to
    <run_dir>/data_report.json when run_dir is given.
    """
    if spec.data.name == "folder":
        from zerotune.data.prepare import folder_loader

        return folder_loader(spec, micro_batch, seed, run_dir)
    return DataLoader(build_dataset(spec), batch_size=micro_batch, shuffle=True, drop_last=True,
                      num_workers=spec.data.num_workers, generator=torch.Generator().manual_seed(seed))

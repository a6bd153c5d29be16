"""Data sets by name (cfg.data.name); each loads its own module on demand (scikit-learn, PIL and the
latent cache are heavy, and a job needs one of them). Items are dicts: "x0" (the clean sample) plus conditioning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from zerotune.errors import ConfigError
from zerotune.models import latent_shape, unet_config


def build_dataset(cfg: Any) -> Dataset:
    name, model = cfg.data.name, cfg.model
    shape = latent_shape(model, int(cfg.resolution.size))
    if name == "digits":
        if model.conditioning != "class" or int(model.vae_scale_factor) != 1 or shape[0] != 1:
            raise ConfigError("data", f"digits are 1-channel pixel images with class labels; model={model.name} "
                              "does not take those", "model=tiny with data=digits, or data=synthetic")
        from zerotune.data.digits import DigitsDataset

        return DigitsDataset(size=int(cfg.resolution.size), split="train", seed=int(cfg.train.seed))
    if name == "synthetic":
        return _synthetic(cfg, shape)
    if name == "folder":
        from zerotune.data.prepare import prepare_folder_data

        return prepare_folder_data(cfg)[0]
    raise ConfigError("data.name", f"unknown data set {name!r}", "data=digits, data=synthetic or data=folder")


def check_data(cfg: Any) -> None:
    """The data checks that load no model (seconds): for the parent process, before workers start."""
    if cfg.data.name == "folder":
        from zerotune.data.prepare import check_folder_data

        check_folder_data(cfg)


def _synthetic(cfg: Any, shape: tuple[int, int, int]) -> Dataset:
    from zerotune.data.synthetic import SyntheticDataset

    unet = unet_config(cfg.model)
    # SDXL's pooled text embedding: what the added-conditioning projection takes besides 6 time ids.
    pooled = int(unet.get("projection_class_embeddings_input_dim", 2816)) - 6 * int(
        unet.get("addition_time_embed_dim", 256))
    return SyntheticDataset(
        num_samples=int(cfg.data.num_samples), latent_shape=shape, conditioning=cfg.model.conditioning,
        pixel_size=int(cfg.resolution.size), text_seq_len=int(cfg.model.get("text_seq_len", 77)),
        cross_attention_dim=int(unet.get("cross_attention_dim") or 0), text_embeds_dim=pooled,
        num_classes=int(cfg.model.get("num_classes", 10)), seed=int(cfg.train.seed))


def build_loader(cfg: Any, micro_batch: int, seed: int, run_dir: str | Path | None = None) -> DataLoader:
    """The training DataLoader: shuffled by a seeded generator, whole batches only.

    data=folder: batches from one aspect-ratio bucket each, read from the latent cache (filled first, by
    one process per node); `loader.dataset.report` is its data report, also written to
    <run_dir>/data_report.json when run_dir is given.
    """
    if cfg.data.name == "folder":
        from zerotune.data.prepare import folder_loader

        return folder_loader(cfg, micro_batch, seed, run_dir)
    return DataLoader(build_dataset(cfg), batch_size=micro_batch, shuffle=True, drop_last=True,
                      num_workers=int(cfg.data.num_workers), generator=torch.Generator().manual_seed(seed))

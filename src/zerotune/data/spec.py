"""What the data package needs from the config, and nothing more: its own node, the model's, the pixel
size, the micro batch and the seed."""

from __future__ import annotations

from dataclasses import dataclass

from zerotune.config.schema import Config, Data, Model


@dataclass(frozen=True)
class DataSpec:
    data: Data
    model: Model
    resolution: int    # pixel side
    batch_size: int    # micro batch per process
    seed: int

    @classmethod
    def from_config(cls, cfg: Config) -> DataSpec:
        return cls(cfg.data, cfg.model, cfg.resolution.size, cfg.train.batch_size, cfg.train.seed)

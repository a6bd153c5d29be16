"""What the data package needs from the config, and nothing more: its own node, the model's, the pixel
size, the micro batch and the seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotune.schema import Config


@dataclass(frozen=True)
class DataSpec:
    data: Any          # the `data` node (schema.Data)
    model: Any         # the `model` node (schema.Model)
    resolution: int    # pixel side
    batch_size: int    # micro batch per process
    seed: int

    @classmethod
    def from_config(cls, cfg: Config) -> DataSpec:
        return cls(cfg.data, cfg.model, cfg.resolution.size, cfg.train.batch_size, cfg.train.seed)

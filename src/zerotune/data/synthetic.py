"""Random inputs of the model's exact shapes: memory and speed do not depend on their values."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    """Deterministic per index, so every process and every resume sees the same items."""

    def __init__(self, num_samples: int, latent_shape: tuple[int, int, int], conditioning: str,
                 pixel_size: int, text_seq_len: int = 77, cross_attention_dim: int = 2048,
                 text_embeds_dim: int = 1280, num_classes: int = 10, seed: int = 0):
        self.n, self.shape, self.kind = num_samples, latent_shape, conditioning
        self.pixel_size, self.seq, self.dim, self.pooled = pixel_size, text_seq_len, cross_attention_dim, text_embeds_dim
        self.num_classes, self.seed = num_classes, seed

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
            item["text_embeds"] = torch.randn(self.pooled, generator=g)
            # SDXL's time_ids: original size, crop top-left, target size.
            item["time_ids"] = torch.tensor([s, s, 0.0, 0.0, s, s])
        return item

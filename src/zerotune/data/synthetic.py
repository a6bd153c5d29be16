"""Random inputs of the model's exact shapes: memory and speed do not depend on their values."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from zerotune.data.spec import DataSpec
from zerotune.models import unet_config


class SyntheticDataset(Dataset):
    """Deterministic per index, so every process and every resume sees the same items."""

    def __init__(self, spec: DataSpec, latent_shape: tuple[int, int, int]):
        model, unet = spec.model, unet_config(spec.model)
        self.n, self.shape, self.seed = spec.data.num_samples, latent_shape, spec.seed
        self.kind, self.pixel_size = model.conditioning, spec.resolution
        self.seq, self.num_classes = int(model.text_seq_len), int(model.num_classes)
        self.dim = int(unet.get("cross_attention_dim") or 0)
        # SDXL's pooled text embedding: what the added-conditioning projection takes besides 6 time ids.
        self.pooled = int(unet.get("projection_class_embeddings_input_dim", 2816)) - 6 * int(
            unet.get("addition_time_embed_dim", 256))

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
            item["text_embeds"] = torch.randn(self.pooled, generator=g)
            # SDXL's time_ids: original size, crop top-left, target size.
            item["time_ids"] = torch.tensor([s, s, 0.0, 0.0, s, s])
        return item

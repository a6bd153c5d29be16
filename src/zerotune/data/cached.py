"""Training items read back from the latent cache: {"x0", "encoder_hidden_states"}, and SDXL's added
conditioning {"text_embeds", "time_ids"}; with model.train_text_encoder, the trained encoders' tokens too
({"input_ids", "input_ids_2"}), from which those encoders compute their part of the condition at each step."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from zerotune.data.buckets import Bucket
from zerotune.data.latent_cache import CacheItem, LatentCache
from zerotune.data.sampler import SampleRef


class CachedFolderDataset(Dataset):
    """One sample per image and repeat; index with an int, or (int, flipped) under random_flip."""

    def __init__(self, cache: LatentCache, items: list[CacheItem], tokens: dict[str, torch.Tensor] | None = None):
        """`tokens`: {key: [len(items), seq]} per trained text encoder, in `items`' order."""
        self.cache, self.items, self.tokens = cache, items, tokens or {}
        # A repeated image is several samples that read the same entries.
        self._item_of = [i for i, it in enumerate(items) for _ in range(it.record.repeats)]
        self.buckets: list[Bucket] = [items[i].placement.bucket for i in self._item_of]
        self.report: dict = {}  # filled by prepare_folder_data, for the run's summary

    def __len__(self) -> int:
        return len(self._item_of)

    def __getitem__(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        index, flipped = ref if isinstance(ref, tuple) else (ref, False)
        i = self._item_of[index]
        item = self.items[i]
        hidden, pooled = self.cache.get_text(item.text_key)
        sample = {"x0": self.cache.get("latents", item.latent_keys[flipped])["latents"], "encoder_hidden_states": hidden}
        if pooled is not None:  # SDXL: the added conditioning
            sample.update(text_embeds=pooled, time_ids=torch.tensor(item.placement.time_ids(flipped)))
        sample.update({key: ids[i] for key, ids in self.tokens.items()})
        return sample

"""How a batch conditions the U-Net, per model kind, and how the condition is dropped for guidance."""

from __future__ import annotations

import torch

NULL_CLASS = 10  # the class index reserved for "no class" (classifier-free guidance)


def unet_kwargs(kind: str, batch: dict) -> dict:
    """Keyword arguments for unet(sample, timestep, **kwargs)."""
    if kind == "class":
        return {"encoder_hidden_states": None, "class_labels": batch["class_labels"]}
    if kind == "text":  # SD 1.x / 2.x: one text encoder's hidden states, nothing added
        return {"encoder_hidden_states": batch["encoder_hidden_states"]}
    if kind == "text_time":
        return {"encoder_hidden_states": batch["encoder_hidden_states"],
                "added_cond_kwargs": {"text_embeds": batch["text_embeds"], "time_ids": batch["time_ids"]}}
    raise ValueError(f"unknown conditioning kind {kind!r}")


def drop_condition(kind: str, batch: dict, prob: float, generator: torch.Generator,
                   uniform: torch.Tensor | None = None) -> dict:
    """Replace the condition by the null condition for a random `prob` share of the batch.

    `uniform`: the batch's U(0, 1) draws, if already drawn (for the global batch, sliced per rank).
    """
    if prob <= 0:
        return batch
    keys = {"class": ("class_labels",), "text": ("encoder_hidden_states",),
            "text_time": ("encoder_hidden_states", "text_embeds")}[kind]
    n = batch[keys[0]].shape[0]
    drop = (torch.rand(n, generator=generator) if uniform is None else uniform) < prob
    out = dict(batch)
    for key in keys:
        value = batch[key]
        mask = drop.to(value.device).view(-1, *([1] * (value.dim() - 1)))
        null = torch.full_like(value, NULL_CLASS) if kind == "class" else torch.zeros_like(value)
        out[key] = torch.where(mask, null, value)
    return out

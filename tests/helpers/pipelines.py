"""A run's export as the diffusers pipeline users load it into, with the local tiny components it trained beside."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def exported_pipeline(run: Path, parts: Path, out: Path) -> Any:
    """`zerotune export` of `run` into `out`, its U-Net in StableDiffusionXLPipeline where `parts` has a second
    text encoder (SDXL), else in StableDiffusionPipeline (SD 1.x / 2.x)."""
    from diffusers import UNet2DConditionModel

    from zerotune.rundir.export import export

    export(run, out)
    return pipeline(parts, UNet2DConditionModel.from_pretrained(out / "unet"))


def pipeline(parts: Path, unet: Any, **encoders: Any) -> Any:
    """The diffusers pipeline of `parts` (a tiny components folder) around `unet`; `encoders`: text_encoder /
    text_encoder_2 in place of the folder's."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    common = dict(vae=AutoencoderKL.from_pretrained(parts / "vae"), unet=unet,
                  text_encoder=encoders.get("text_encoder") or CLIPTextModel.from_pretrained(parts / "text_encoder"),
                  tokenizer=CLIPTokenizer.from_pretrained(parts / "tokenizer"),
                  scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012))
    if (parts / "text_encoder_2").is_dir():
        te2 = encoders.get("text_encoder_2") or CLIPTextModelWithProjection.from_pretrained(parts / "text_encoder_2")
        pipe = StableDiffusionXLPipeline(**common, text_encoder_2=te2,
                                         tokenizer_2=CLIPTokenizer.from_pretrained(parts / "tokenizer_2"),
                                         add_watermarker=False)
    else:
        pipe = StableDiffusionPipeline(**common, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe: Any, prompt: str, **kwargs: Any) -> np.ndarray:
    """One 64x64 image in 3 steps from a fixed seed, as an array."""
    return pipe(prompt, height=64, width=64, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                output_type="np", **kwargs).images[0]

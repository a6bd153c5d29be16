"""Original-layout single-file checkpoints made from a diffusers U-Net, as A1111 and ComfyUI load them.

The layout's names and shapes are those of the original Stable Diffusion UNetModel (the `ldm` package that
`make setup` installs), plus SDXL's `label_emb`, which that code predates, by diffusers' own
DIFFUSERS_TO_LDM_MAPPING. Which diffusers tensor goes under which name is found by running diffusers' own
conversion (original → diffusers) on a probe whose i-th tensor is filled with i: no table is written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def original_unet(config: dict) -> Any:
    """The original UNetModel of the architecture a diffusers U-Net config describes (one transformer per
    attention block, as the tiny test models have)."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    channels = list(config["block_out_channels"])
    depth = config.get("transformer_layers_per_block") or 1
    assert set(depth if isinstance(depth, list | tuple) else [depth]) == {1}, "one transformer per block"
    return UNetModel(image_size=config["sample_size"], in_channels=config["in_channels"],
                     out_channels=config["out_channels"], model_channels=channels[0],
                     channel_mult=[c // channels[0] for c in channels], num_res_blocks=config["layers_per_block"],
                     attention_resolutions=[2 ** i for i, kind in enumerate(config["down_block_types"])
                                            if kind.startswith("CrossAttn")],
                     num_heads=4, use_spatial_transformer=True, transformer_depth=1,
                     context_dim=config["cross_attention_dim"], legacy=False,
                     use_linear_in_transformer=bool(config.get("use_linear_projection")))


def original_layout(unet: Any) -> dict[str, torch.Tensor]:
    """`unet`'s weights under the original layout's names (`model.diffusion_model.` ...), each tensor once."""
    from diffusers.loaders.single_file_utils import (
        DIFFUSERS_TO_LDM_MAPPING,
        LDM_UNET_KEY,
        convert_ldm_unet_checkpoint,
    )

    config, weights = dict(unet.config), unet.state_dict()
    shapes = {LDM_UNET_KEY + name: tuple(t.shape) for name, t in original_unet(config).state_dict().items()}
    if config.get("addition_embed_type") == "text_time":
        for diffusers_name, ldm_name in DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"].items():
            shapes[LDM_UNET_KEY + ldm_name] = tuple(weights[diffusers_name].shape)
    names = list(shapes)
    probe = {name: torch.full(shape, float(i)) for i, (name, shape) in enumerate(shapes.items())}
    converted = convert_ldm_unet_checkpoint(dict(probe), config)
    assert set(converted) == set(weights), set(converted) ^ set(weights)
    layout: dict[str, torch.Tensor] = {}
    for diffusers_name, marked in converted.items():
        assert marked.min() == marked.max(), f"{diffusers_name} mixes original tensors"
        name = names[int(marked.flatten()[0])]
        assert name not in layout, f"{name} converts to two diffusers tensors"
        layout[name] = weights[diffusers_name].reshape(shapes[name]).clone()
    assert set(layout) == set(shapes), set(shapes) - set(layout)
    return layout


def write_checkpoint(unet: Any, path: Path) -> Path:
    """A single-file checkpoint of `unet`, with a VAE tensor beside it as a whole checkpoint has (which the
    U-Net's loader must leave alone)."""
    from safetensors.torch import save_file

    save_file({**original_layout(unet), "first_stage_model.decoder.conv_in.weight": torch.ones(4, 4, 3, 3)},
              str(path))
    return path

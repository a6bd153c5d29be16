"""A 2.4M-parameter class-conditional UNet2DConditionModel for the 8x8 sklearn digits, in pixel space.

Two resolutions (8x8 at 64 channels, 4x4 at 128) of plain ResNet blocks; 8x8 rather than upsampled
16x16 because it is ~3x cheaper per step on CPU and the scorer works on 8x8 anyway. FiLM-style
"scale_shift" time/class conditioning.

No block has cross-attention, so the U-Net never reads `encoder_hidden_states`; but diffusers'
UNet2DConditionModel.forward takes it as a required positional argument, so it must be passed
explicitly as None. Conditioning goes only through `class_labels` (an nn.Embedding added to the
timestep embedding).
"""

from __future__ import annotations

from typing import Any

import torch

NULL_CLASS = 10  # label that classifier-free guidance drops to; digits use 0..9
NUM_CLASS_EMBEDS = NULL_CLASS + 1

# Plain JSON-able values (lists, not tuples) so they can be mirrored in conf/model/tiny.yaml.
TINY_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,
    "in_channels": 1,
    "out_channels": 1,
    "down_block_types": ["DownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D"],
    "mid_block_type": "UNetMidBlock2D",
    "block_out_channels": [64, 128],
    "layers_per_block": 1,
    "norm_num_groups": 16,
    "resnet_time_scale_shift": "scale_shift",
    "num_class_embeds": NUM_CLASS_EMBEDS,
}


def tiny_unet_kwargs(class_labels: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for `unet(sample, timestep, **kwargs)`; `.sample` of the result is the prediction."""
    return {"encoder_hidden_states": None, "class_labels": class_labels}

"""An adapter-trained U-Net's export: the adapter as diffusers' own LoRA training scripts save it
(`unet.<module>.lora_A.weight` keys, the LoRA config in the file's metadata), and optionally the U-Net with
the adapter merged in, by diffusers' own fuse/unload."""

from __future__ import annotations

from pathlib import Path

from zerotune.models import adapter
from zerotune.schema import Adapter

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE


def build(unet_config: dict, adapter_cfg: dict, weights: dict):
    """The U-Net with its adapter, holding `weights` (base and adapter, by the module's own names)."""
    from diffusers import UNet2DConditionModel

    unet = adapter.add_adapter(UNet2DConditionModel.from_config(unet_config), Adapter(**adapter_cfg))
    unet.load_state_dict(weights, strict=True)
    return unet


def save(unet_config: dict, adapter_cfg: dict, weights: dict, out: Path, suffix: str, merge: bool) -> dict:
    """Write lora{suffix}/ (and with `merge` unet{suffix}/ + unet{suffix}.safetensors); returns what was written."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from safetensors.torch import save_file

    unet = build(unet_config, adapter_cfg, weights)
    folder = out / f"lora{suffix}"
    # save_lora_weights is a classmethod: it only prefixes `unet.` and writes the file, for any U-Net.
    StableDiffusionXLPipeline.save_lora_weights(
        folder, unet_lora_layers=convert_state_dict_to_diffusers(adapter.adapter_state_dict(unet)),
        unet_lora_adapter_metadata=unet.peft_config[adapter.ADAPTER_NAME].to_dict(), weight_name=WEIGHT_NAME)
    written = {f"lora{suffix}": str(folder / WEIGHT_NAME)}
    if merge:
        unet.fuse_lora(adapter_names=[adapter.ADAPTER_NAME])
        unet.unload_lora()
        unet.save_pretrained(out / f"unet{suffix}", safe_serialization=True)
        save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(out / f"unet{suffix}.safetensors"))
        written[f"unet{suffix}"] = str(out / f"unet{suffix}")
    return written

"""An adapter-trained U-Net's export: the adapter as diffusers' own LoRA training scripts save it
(`unet.<module>.lora_A.weight` keys, the LoRA config in the file's metadata; with trained text encoders their
adapters under `text_encoder.` / `text_encoder_2.`, as train_dreambooth_lora_sdxl.py saves them), and optionally
the U-Net (and encoders) with the adapter merged in, by diffusers' own fuse/unload."""

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


def build_encoder(name: str, config: dict, adapter_cfg: dict, weights: dict):
    """A trained text encoder with its adapter, holding `weights` (base and adapter, by the module's own names)."""
    from zerotune.models import text_encoders

    encoder = text_encoders.add_adapter(text_encoders.build(name, config), Adapter(**adapter_cfg))
    encoder.load_state_dict(weights, strict=True)
    return encoder


def save(unet_config: dict, adapter_cfg: dict, weights: dict, out: Path, suffix: str, merge: bool,
         encoders: dict[str, tuple[dict, dict]] | None = None) -> dict[str, str]:
    """Write lora{suffix}/ (and with `merge` unet{suffix}/ + unet{suffix}.safetensors, and each trained encoder's
    folder); returns what was written. `encoders`: {name: (config, weights)} of the trained text encoders."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from diffusers.utils.peft_utils import recurse_remove_peft_layers
    from safetensors.torch import save_file

    unet = build(unet_config, adapter_cfg, weights)
    trained = {name: build_encoder(name, config, adapter_cfg, w) for name, (config, w) in (encoders or {}).items()}
    folder = out / f"lora{suffix}"
    layers = {f"{name}_lora_layers": convert_state_dict_to_diffusers(adapter.adapter_state_dict(module))
              for name, module in trained.items()}
    metadata = {f"{name}_lora_adapter_metadata": module.peft_config[adapter.ADAPTER_NAME].to_dict()
                for name, module in trained.items()}
    # save_lora_weights is a classmethod: it only prefixes `unet.` / `text_encoder.` ... and writes the file, for
    # any U-Net; SDXL's takes both encoders' layers (an SD 1.x/2.x pipeline reads its text_encoder's the same way).
    StableDiffusionXLPipeline.save_lora_weights(
        folder, unet_lora_layers=convert_state_dict_to_diffusers(adapter.adapter_state_dict(unet)),
        unet_lora_adapter_metadata=unet.peft_config[adapter.ADAPTER_NAME].to_dict(), weight_name=WEIGHT_NAME,
        **layers, **metadata)
    written = {f"lora{suffix}": str(folder / WEIGHT_NAME)}
    if merge:
        unet.fuse_lora(adapter_names=[adapter.ADAPTER_NAME])
        unet.unload_lora()
        unet.save_pretrained(out / f"unet{suffix}", safe_serialization=True)
        save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(out / f"unet{suffix}.safetensors"))
        written[f"unet{suffix}"] = str(out / f"unet{suffix}")
        for name, module in trained.items():
            from peft.tuners.tuners_utils import BaseTunerLayer

            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.merge(adapter_names=[adapter.ADAPTER_NAME])
            recurse_remove_peft_layers(module)
            module.save_pretrained(out / f"{name}{suffix}", safe_serialization=True)
            written[f"{name}{suffix}"] = str(out / f"{name}{suffix}")
    return written

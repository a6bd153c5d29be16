"""U-Net construction: from an architecture config (random init) or a local pretrained path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from zerotune.errors import ConfigError


@dataclass(frozen=True)
class ModelStats:
    """What the DeepSpeed dict builder needs to know about the model, measured on a meta-device copy."""

    num_params: int
    largest_param_numel: int


def unet_config(model_cfg: Any) -> dict:
    return OmegaConf.to_container(model_cfg.unet, resolve=True) if not isinstance(model_cfg.unet, dict) \
        else dict(model_cfg.unet)


def downsample_factor(model_cfg: Any) -> int:
    """How many times the U-Net halves its input: one less than the number of blocks."""
    return 2 ** (len(unet_config(model_cfg)["block_out_channels"]) - 1)


def latent_shape(model_cfg: Any, size: int) -> tuple[int, int, int]:
    """(channels, height, width) of the U-Net's input at pixel side `size`; refuses sizes it cannot take."""
    vae, down = model_cfg.vae_scale_factor, downsample_factor(model_cfg)
    if not isinstance(size, int) or size <= 0:
        raise ConfigError("resolution.size", f"must be a positive integer, got {size!r}", "resolution=1024")
    if size % (vae * down):
        ok = [s for s in (size - size % (vae * down), size + (vae * down) - size % (vae * down)) if s > 0]
        raise ConfigError("resolution.size", f"{size} px is not divisible by {vae * down}: model "
                          f"{model_cfg.name} encodes by {vae} and its U-Net halves {down.bit_length() - 1} times",
                          f"resolution.size={' or '.join(map(str, ok))}")
    return int(unet_config(model_cfg)["in_channels"]), size // vae, size // vae


def _from_config(model_cfg: Any):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**unet_config(model_cfg))


def model_stats(model_cfg: Any) -> ModelStats:
    """Parameter counts from a meta-device build: no memory, no weights."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        unet = _from_config(model_cfg)
    numels = [p.numel() for p in unet.parameters()]
    return ModelStats(num_params=sum(numels), largest_param_numel=max(numels))


def build_unet(model_cfg: Any):
    """A U-Net from `model.pretrained` (a diffusers folder or a .safetensors state dict) or from its config."""
    pretrained = model_cfg.get("pretrained")
    if not pretrained:
        unet = _from_config(model_cfg)
    else:
        unet = load_pretrained(model_cfg, Path(str(pretrained)).expanduser())
    if model_cfg.get("attention") == "sdpa":
        from diffusers.models.attention_processor import AttnProcessor2_0

        unet.set_attn_processor(AttnProcessor2_0())
    return unet


def load_pretrained(model_cfg: Any, path: Path):
    from diffusers import UNet2DConditionModel

    key = "model.pretrained"
    if path.is_dir():
        folder = path / "unet" if (path / "unet" / "config.json").is_file() else path
        if not (folder / "config.json").is_file():
            raise ConfigError(key, f"{path} holds no diffusers U-Net (no config.json in it or in unet/)",
                              "point model.pretrained at a folder saved by UNet2DConditionModel.save_pretrained")
        return UNet2DConditionModel.from_pretrained(folder, local_files_only=True)
    if path.suffix == ".safetensors" and path.is_file():
        from safetensors.torch import load_file

        unet = _from_config(model_cfg)
        missing, unexpected = unet.load_state_dict(load_file(str(path)), strict=False)
        if missing or unexpected:
            raise ConfigError(key, f"{path} does not match model={model_cfg.name}: {len(missing)} missing keys "
                              f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})",
                              "choose the model option whose architecture the weights were saved from")
        return unet
    raise ConfigError(key, f"{path} is neither a diffusers folder nor a .safetensors file",
                      "model.pretrained=/path/to/unet_folder or /path/to/unet.safetensors")

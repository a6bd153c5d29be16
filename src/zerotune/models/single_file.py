"""Original-layout single-file checkpoints: the `.safetensors` files A1111 and ComfyUI load, whose U-Net is
stored under `model.diffusion_model.` beside the VAE and the text encoders.

They are read with diffusers' own single-file loader and conversion (`from_single_file`,
`convert_ldm_unet_checkpoint`). The U-Net's config is the model option's architecture, written to a local
folder for `from_single_file`: it is never fetched from a hub.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from zerotune.errors import ConfigError

KEY = "model.pretrained"
WRONG_MODEL_FIX = "choose the model option whose architecture the checkpoint was saved from (model=sd15, model=sdxl ...)"


def unet_prefix() -> str:
    from diffusers.loaders.single_file_utils import LDM_UNET_KEY

    return LDM_UNET_KEY


def is_original_layout(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names are the original layout's: its U-Net under `model.diffusion_model.`."""
    prefix = unet_prefix()
    return any(name.startswith(prefix) for name in names)


def _convert(tensors: dict[str, torch.Tensor], config: dict, path: Path) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    try:
        return convert_ldm_unet_checkpoint(tensors, config)
    except KeyError as exc:  # the conversion looks up the tensors the config's architecture needs
        raise ConfigError(KEY, f"{path} is an original-layout checkpoint without the U-Net tensor {exc} that "
                          "the model option's architecture needs", WRONG_MODEL_FIX) from None


def converted_shapes(header: dict[str, tuple[int, ...]], config: dict, path: Path) -> dict[str, tuple[int, ...]]:
    """The diffusers names and shapes that diffusers' conversion makes of the U-Net tensors in `header`.
    It runs on meta tensors, so no tensor is read."""
    prefix = unet_prefix()
    meta = {name: torch.empty(shape, device="meta") for name, shape in header.items() if name.startswith(prefix)}
    return {name: tuple(tensor.shape) for name, tensor in _convert(meta, config, path).items()}


def converted_unet_tensors(path: Path, config: dict) -> dict[str, torch.Tensor]:
    """The U-Net's tensors in diffusers' layout. Only the U-Net's tensors are read, not the VAE's or the
    text encoders'."""
    from safetensors import safe_open

    prefix = unet_prefix()
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys() if name.startswith(prefix)}
    return _convert(tensors, config, path)


def load(path: Path, config: dict):
    """The U-Net of an original-layout checkpoint, in fp32, through diffusers' `from_single_file`."""
    from diffusers import UNet2DConditionModel

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        return UNet2DConditionModel.from_single_file(str(path), config=folder, local_files_only=True,
                                                     torch_dtype=torch.float32)

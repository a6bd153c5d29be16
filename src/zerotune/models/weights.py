"""`model.pretrained`'s files read without their tensors: a diffusers folder's config and weight files, and
safetensors headers (tensor names and shapes), so a wrong path or a broken file is refused in seconds."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from zerotune.errors import ConfigError

KEY = "model.pretrained"
FOLDER_FIX = "point model.pretrained at a folder saved by UNet2DConditionModel.save_pretrained"
SHOWN = 3  # names listed per kind of mismatch


def unet_folder(path: Path) -> Path | None:
    """The folder holding the U-Net's config.json: `path`, or its unet/ (a whole pipeline's folder)."""
    for folder in (path / "unet", path):
        if (folder / "config.json").is_file():
            return folder
    return None


def found_unet_folder(path: Path) -> Path:
    """`unet_folder`, refused where `path` holds none."""
    folder = unet_folder(path)
    if folder is None:
        raise ConfigError(KEY, f"{path} holds no diffusers U-Net (no config.json in it or in unet/)", FOLDER_FIX)
    return folder


def read_folder(path: Path) -> tuple[dict, list[Path]]:
    """The U-Net's config.json and the safetensors files `from_pretrained` would read ([] for .bin weights,
    which are only looked for)."""
    folder = found_unet_folder(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(KEY, f"{folder / 'config.json'} is not readable JSON ({exc})", FOLDER_FIX) from None
    return config, _weight_files(folder)


def _weight_files(folder: Path) -> list[Path]:
    from diffusers.utils import constants as names  # the file names from_pretrained looks for

    if (folder / names.SAFETENSORS_WEIGHTS_NAME).is_file():
        return [folder / names.SAFETENSORS_WEIGHTS_NAME]
    index = folder / names.SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(KEY, f"{index} is not a safetensors index ({exc!r})", FOLDER_FIX) from None
        return [folder / shard for shard in shards]
    if (folder / names.WEIGHTS_NAME).is_file() or (folder / names.WEIGHTS_INDEX_NAME).is_file():
        return []
    raise ConfigError(KEY, f"{folder} has a config.json but no weights (no {names.SAFETENSORS_WEIGHTS_NAME}, "
                      f"{names.SAFE_WEIGHTS_INDEX_NAME} or {names.WEIGHTS_NAME})", FOLDER_FIX)


def read_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header; the file is mapped, no tensor is read."""
    if not file.is_file():
        raise ConfigError(KEY, f"{file} does not exist", "copy the missing file, or fix model.pretrained")
    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        if "incomplete metadata" in str(exc):  # the header describes more bytes than the file has
            raise ConfigError(KEY, f"{file} is truncated: its header lists more tensor data than its "
                              f"{file.stat().st_size} bytes hold ({exc})", "copy the file again, completely") from None
        raise ConfigError(KEY, f"{file} is not a safetensors file ({exc})",
                          "point model.pretrained at a .safetensors file of the U-Net's state dict") from None


def compare_shapes(file: Path | str, found: dict, expected: dict, model: str) -> None:
    """Refuse weights whose tensor names or shapes differ from the U-Net they will be loaded into."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    reshaped = [f"{name} {list(found[name])} (model: {list(expected[name])})"
                for name in sorted(expected.keys() & found.keys()) if found[name] != expected[name]]
    kinds = (("keys missing", missing), ("unexpected keys", unexpected), ("shapes differ", reshaped))
    parts = [f"{len(names)} {what} (e.g. {', '.join(names[:SHOWN])})" for what, names in kinds if names]
    if parts:
        raise ConfigError(KEY, f"{file} does not match {model}: {'; '.join(parts)}",
                          "choose the model option whose architecture the weights were saved from")

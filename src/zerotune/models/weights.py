"""`model.pretrained`'s weights (a diffusers folder, or an original-layout single file as A1111 and ComfyUI load, read
with diffusers' own conversion), checked from headers in seconds, and loaded module by module into a U-Net built under
ZeRO-3's zero.Init: rank 0 copies each gathered module's tensors in and DeepSpeed broadcasts them, as transformers does.
diffusers' `from_pretrained` cannot: it ignores zero.Init and reads every weight whole on every rank."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from zerotune.config.errors import ConfigError

KEY = "model.pretrained"
FOLDER_FIX = "point model.pretrained at a pipeline folder, or its unet/ or transformer/ (saved by save_pretrained)"
SHOWN = 3  # names listed per kind of mismatch


def network_folder(path: Path, sub: str = "unet") -> Path | None:
    """The folder holding the network's config.json: `path`, or its `sub`/ (a whole pipeline's folder: unet/ for
    a U-Net, transformer/ for a diffusion transformer)."""
    for folder in (path / sub, path):
        if (folder / "config.json").is_file():
            return folder
    return None


def found_network_folder(path: Path, sub: str = "unet") -> Path:
    """`network_folder`, refused where `path` holds none."""
    folder = network_folder(path, sub)
    if folder is None:
        raise ConfigError(KEY, f"{path} holds no diffusers {'U-Net' if sub == 'unet' else sub} (no config.json in it "
                          f"or in {sub}/)", FOLDER_FIX)
    return folder


def read_folder(path: Path, sub: str = "unet") -> tuple[dict, list[Path]]:
    """The network's config.json and the safetensors files `from_pretrained` would read ([] for .bin weights,
    which are only looked for)."""
    folder = found_network_folder(path, sub)
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
    """The U-Net of an original-layout checkpoint, in fp32, through diffusers' `from_single_file` (its config
    written to a local folder: never fetched from a hub)."""
    from diffusers import UNet2DConditionModel

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        return UNet2DConditionModel.from_single_file(str(path), config=folder, local_files_only=True,
                                                     torch_dtype=torch.float32)


class Weights(Protocol):
    """Tensors by name, with their shapes known before any tensor is read."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


def build(make_unet, init: contextlib.AbstractContextManager, weights: Weights | None, what: str):
    """`make_unet()` under `init`, then `weights` loaded in (None: keep the seeded random init)."""
    with init:
        unet = make_unet()
    if weights is not None:
        load_into_partitioned(unet, weights, what)
    return unet


class FileWeights:
    """Tensors by name from safetensors files (read one at a time) or torch .bin files (memory-mapped)."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()
        for file in files:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                self._where.update({name: handle for name in handle.keys()})
            else:
                state = torch.load(str(file), map_location="cpu", mmap=True, weights_only=True)
                self._where.update({name: state for name in state})

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        source = self._where[name]
        return tuple(source.get_slice(name).get_shape() if hasattr(source, "get_slice") else source[name].shape)

    def get(self, name: str) -> torch.Tensor:
        source = self._where[name]
        return source.get_tensor(name) if hasattr(source, "get_tensor") else source[name]

    def close(self) -> None:
        self._stack.close()


class ConvertedWeights:
    """An original-layout single file's U-Net in diffusers' names. Names and shapes come from the header (every
    rank); the tensors are converted on the first `get`, which only rank 0 makes (the U-Net has no persistent
    buffers, which every rank would read)."""

    def __init__(self, path: Path, config: dict):
        self._path, self._config = path, config
        self._shapes = converted_shapes(read_shapes(path), config, path)
        self._tensors: dict[str, torch.Tensor] | None = None

    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        if self._tensors is None:
            self._tensors = converted_unet_tensors(self._path, self._config)
        return self._tensors[name]

    def close(self) -> None:
        self._tensors = None


@torch.no_grad()
def load_into_partitioned(unet: torch.nn.Module, weights: Weights, what: str) -> None:
    """Every rank calls this (each gather is a collective); only rank 0 reads parameter tensors."""
    import deepspeed
    import torch.distributed as dist

    try:
        # On every rank, from the files' headers: no rank stops alone mid-gather. A partitioned parameter's
        # whole shape is its ds_shape.
        expected = {name: tuple(getattr(t, "ds_shape", t.shape)) for name, t in unet.state_dict(keep_vars=True).items()}
        compare_shapes(what, {name: weights.shape(name) for name in weights.names()}, expected, "the model")
        is_writer = dist.get_rank() == 0
        for prefix, module in unet.named_modules():
            prefix = f"{prefix}." if prefix else ""
            params = list(module.named_parameters(recurse=False))
            # Buffers are not partitioned: every rank loads its own (the U-Net's are few and small).
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    buf.data.copy_(weights.get(prefix + name))
            if not params:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                if is_writer:
                    for name, param in params:
                        param.data.copy_(weights.get(prefix + name))
    finally:
        weights.close()


@contextlib.contextmanager
def transformers_zero3_lifted() -> Iterator[None]:
    """transformers (and peft, which asks it) told ZeRO-3 is off meanwhile: frozen encoders are loaded whole,
    never partitioned, and peft does not gather weights gathered already. At ZeRO-3 accelerate registers its
    DeepSpeed config with transformers (`DeepSpeedPlugin.dschf`), whose from_pretrained then builds under zero.Init
    and leaves each rank a 1-D placeholder of every weight, which no engine ever gathers. accelerate's own
    `zero3_init_context_manager(enable=False)` registers the same ZeRO-3 config again (it builds the
    HfDeepSpeedConfig whatever the flag), so transformers' registration is lifted here and put back after."""
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    registered = getattr(plugin, "dschf", None)
    if registered is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)

"""The U-Net built under ZeRO-3's `deepspeed.zero.Init`: each module's parameters are partitioned across the
ranks as soon as that module is built, so no rank ever holds the whole model.

`model.pretrained` is loaded module by module into the partitioned model: each module's parameters are
gathered, rank 0 copies its tensors in (read one by one from the files, never the whole state dict; an
original-layout single file is converted whole on rank 0 alone, as diffusers' conversion needs), and
DeepSpeed broadcasts them and re-partitions (`GatheredParameters(modifier_rank=0)`, as transformers loads
into a ZeRO-3 model). diffusers' `from_pretrained` cannot be used: it ignores zero.Init and reads every
weight whole on every rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch

from zerotune.models import single_file
from zerotune.models.weights import compare_shapes, read_shapes


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
        self._shapes = single_file.converted_shapes(read_shapes(path), config, path)
        self._tensors: dict[str, torch.Tensor] | None = None

    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        if self._tensors is None:
            self._tensors = single_file.converted_unet_tensors(self._path, self._config)
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

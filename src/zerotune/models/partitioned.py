"""The U-Net built under ZeRO-3's `deepspeed.zero.Init`: each module's parameters are partitioned across the
ranks as soon as that module is built, so no rank ever holds the whole model.

`model.pretrained` is loaded module by module into the partitioned model: each module's parameters are
gathered, rank 0 copies its tensors in (read one by one from the files, never the whole state dict), and
DeepSpeed broadcasts them and re-partitions (`GatheredParameters(modifier_rank=0)`, as transformers loads
into a ZeRO-3 model). diffusers' `from_pretrained` cannot be used: it ignores zero.Init and reads every
weight whole on every rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from zerotune.models.weights import compare_shapes


def build(make_unet, init: contextlib.AbstractContextManager, weight_files: list[Path] | None, what: str):
    """`make_unet()` under `init`, then the weights of `weight_files` (None: keep the seeded random init)."""
    with init:
        unet = make_unet()
    if weight_files is not None:
        load_into_partitioned(unet, weight_files, what)
    return unet


class _Weights:
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


@torch.no_grad()
def load_into_partitioned(unet: torch.nn.Module, files: list[Path], what: str) -> None:
    """Every rank calls this (each gather is a collective); only rank 0 reads parameter tensors."""
    import deepspeed
    import torch.distributed as dist

    weights = _Weights(files)
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

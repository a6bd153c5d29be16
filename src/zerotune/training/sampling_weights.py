"""The U-Net a validation pass samples with: the weights being trained, whole on this rank, in the training dtype,
in eval mode, with the adapter applied, and optionally the EMA's weights in their place. Everything is put back
as it was on leaving, so the next training step computes what it would have computed without the pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def sampling_unet(engine: Any, module: torch.nn.Module, zero3: bool,
                  ema_shadow: dict[str, torch.Tensor] | None = None) -> Iterator[torch.nn.Module]:
    """`module` (the engine's U-Net) ready to sample. Under ZeRO-3 a collective: every rank enters and leaves.

    `ema_shadow`: {parameter name: fp32 host tensor} copied over the trained parameters for the pass.
    """
    with _whole(engine, module, zero3), _swapped(module, ema_shadow), torch.no_grad():
        was_training = module.training
        module.eval()  # dropout (LoRA's too) off
        try:
            yield module
        finally:
            module.train(was_training)


@contextlib.contextmanager
def _whole(engine: Any, module: torch.nn.Module, zero3: bool) -> Iterator[None]:
    """ZeRO-3: gather every partition (DeepSpeed's GatheredParameters; nothing written back on leaving) and lift
    the engine's forward hooks meanwhile, which would otherwise release each gathered sub-module after its forward
    and fetch it again at the next, a collective per call. TRL's unwrap_model_for_generation does the same; no
    library exposes it for a bare engine, hence these few lines."""
    if not zero3:
        yield
        return
    import deepspeed

    offload = _parameter_offload(engine)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        _remove_hooks(offload)
        try:
            yield
        finally:
            _add_hooks(offload)


def _parameter_offload(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        raise RuntimeError("ZeRO-3 validation needs the DeepSpeed engine's optimizer (its parameter coordinator)")
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_hooks(offload: Any) -> None:
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _add_hooks(offload: Any) -> None:
    # DeepSpeed >= 0.16.4 names it _register_deepspeed_module (it also invalidates the prefetch trace).
    offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, shadow: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """The EMA's weights in place of the trained ones, the trained ones kept on the host and copied back exactly."""
    if shadow is None:
        yield
        return
    params = dict(module.named_parameters())
    missing = sorted(set(shadow) - set(params))
    if missing:
        raise RuntimeError(f"the EMA holds weights the U-Net does not: {missing[:3]}")
    kept = {}
    with torch.no_grad():
        for name, value in shadow.items():
            p = params[name]
            kept[name] = p.detach().to("cpu", copy=True)
            p.copy_(value.to(p.device, p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                params[name].copy_(value.to(params[name].device))

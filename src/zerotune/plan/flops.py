"""FLOPs of one dispatched op, by torch's FlopCounterMode formulas (matmuls, convolutions, attention).

The formulas are FlopCounterMode's own registry, applied by the memory tracker of activations.py to the
ops it already sees, rather than by running FlopCounterMode itself: FlopCounterMode's module tracker
hooks the outputs of every module call, and when it is active during a backward with gradient
checkpointing those hooks keep recomputed activations alive (the tiny U-Net's traced activation peak
rose 83%, 4.1 -> 7.4 MB). Same formulas, same totals (tests/test_plan_activations.py compares them).

The trace runs on fake *CPU* tensors (see activations.py), where scaled_dot_product_attention dispatches
to `_scaled_dot_product_flash_attention_for_cpu`: the registry only knows the CUDA attention kernels, so
two entries are added for it, with the counts torch uses for the CUDA flash kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

aten = torch.ops.aten
Shape = tuple[int, ...]


@shape_wrapper
def _cpu_flash_forward(query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, out_shape: Any = None,
                       **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@shape_wrapper
def _cpu_flash_backward(grad_out_shape: Shape, query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any,
                        out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


FLOP_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def op_flops(func: Any, args: tuple, kwargs: dict | None, out: Any) -> int:
    """What FlopCounterMode would count for this call of `func` (an OpOverload); 0 for elementwise ops."""
    formula = FLOP_FORMULAS.get(getattr(func, "_overloadpacket", None))
    return int(formula(*args, **(kwargs or {}), out_val=out)) if formula is not None else 0

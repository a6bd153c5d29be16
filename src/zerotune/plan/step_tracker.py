"""FLOPs of one dispatched op, by torch's FlopCounterMode formulas (matmuls, convolutions, attention).

The formulas are FlopCounterMode's own registry, applied by the memory tracker of activations.py to the
ops it already sees, rather than by running FlopCounterMode itself: FlopCounterMode's module tracker
hooks the outputs of every module call, and when it is active during a backward with gradient
checkpointing those hooks keep recomputed activations alive (the tiny U-Net's traced activation peak
rose 83%, 4.1 -> 7.4 MB). Same formulas, same totals (tests/test_plan_activations.py compares them).

The trace runs on fake *CPU* tensors (see activations.py), where scaled_dot_product_attention dispatches
to `_scaled_dot_product_flash_attention_for_cpu`: the registry only knows the CUDA attention kernels, so
two entries are added for it, with the counts torch uses for the CUDA flash kernel.

torch's MemTracker, kept to what the planner's trace needs (activations.py): the peak of what a step
holds beyond the model states, the FLOPs of the ops it sees, and gradient hooks on trainable parameters
only (an adapter's frozen base takes none)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
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


_MODEL_STATES = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD)


class StepTracker(MemTracker):
    """MemTracker keeping the peak of what the step holds beyond the model states, and the FLOPs of the
    ops it sees, forward and backward (torch's formulas: flops.py).

    MemTracker's own peak update walks every module it has seen on every op, to keep per-module peaks
    this planner does not use: for SDXL, 1,500 modules x 77,000 ops made a 256 px trace take 185 s
    (95% of it that walk); without it SDXL at 1024 px, batch 8, takes 8 s."""

    def __init__(self) -> None:
        super().__init__()
        self.activation_peak = 0
        self.activation_and_grad_peak = 0
        self.flops = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # is_bw: inside autograd's backward, recomputation under gradient checkpointing included.
        self.flops["backward" if self._mod_tracker.is_bw else "forward"] += op_flops(func, args, kwargs, out)
        return out

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, and torch refuses a hook on a frozen parameter (an
        # adapter's base U-Net): only the trainable ones get them.
        out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        for param in module.parameters() if install_grad_hooks else ():
            if param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._track_grad),
                    param.register_post_accumulate_grad_hook(lambda p: self._track_grad(p.grad)))
        return out

    def _track_grad(self, grad: torch.Tensor) -> None:  # MemTracker's own _grad_hook
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for snapshot in self._curr_mem_snap.values():
            held = snapshot[_TOTAL_KEY] - sum(snapshot[kind] for kind in _MODEL_STATES)
            self.activation_peak = max(self.activation_peak, held)
            # With the parameter gradients autograd has accumulated so far: where a step's backward peaks
            # when the gradients stay in param.grad (ZeRO-0, ZeRO-1).
            self.activation_and_grad_peak = max(self.activation_and_grad_peak, held + snapshot[_MemRefType.GRAD])

    def held(self, kind: _MemRefType) -> int:
        return sum(snapshot[kind] for snapshot in self._curr_mem_snap.values())

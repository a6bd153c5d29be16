"""StepTracker: torch's MemTracker kept to what the planner's trace needs (activations.py): the peak a step holds
beyond the model states, and the FLOPs of the ops it sees, by FlopCounterMode's formulas."""

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


# FlopCounterMode's own formulas, applied to the ops the tracker sees (same totals: tests/test_plan_activations.py):
# FlopCounterMode itself hooks every module's outputs, which under gradient checkpointing keeps recomputed
# activations alive (the tiny U-Net's peak rose 83%). The fake CPU tensors dispatch SDPA to the CPU flash kernel,
# which the registry lacks: it gets the counts torch uses for the CUDA flash kernel.
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
    """MemTracker keeping the peak the step holds beyond the model states, and its forward and backward FLOPs.
    It replaces MemTracker's peak update, which walks every module on every op for per-module peaks: for SDXL a
    256 px trace took 185 s (95% of it that walk); without it 1024 px, batch 8, takes 8 s."""

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

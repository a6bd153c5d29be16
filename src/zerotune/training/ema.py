"""An exponential moving average of the weights, in host memory, outside accelerate and DeepSpeed.

It costs one fp32 copy of the model in host RAM and no accelerator memory. Under ZeRO-3 each
parameter is gathered for the update, since no single process holds it whole.
"""

from __future__ import annotations

import contextlib

import torch


class HostEMA:
    def __init__(self, named_params, decay: float, warmup: bool, zero3: bool):
        self.decay, self.warmup, self.zero3 = float(decay), bool(warmup), zero3
        self.updates = 0
        with self._gathered([p for _, p in named_params]):
            self.shadow = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in named_params}

    def current_decay(self) -> float:
        """Warm-up: early averages forget fast, so the EMA does not stay anchored to the random init."""
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, named_params) -> None:
        d = self.current_decay()
        params = list(named_params)
        with self._gathered([p for _, p in params]):
            for name, p in params:
                self.shadow[name].lerp_(p.detach().to("cpu", torch.float32), 1.0 - d)
        self.updates += 1

    def _gathered(self, params):
        if not self.zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = int(state["updates"])

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

"""An exponential moving average of the weights, in host memory, outside accelerate and DeepSpeed.

It costs one fp32 copy of the model in host RAM and no accelerator memory. Under ZeRO-3 no process
holds a parameter whole: the parameters are gathered for the copy and for each update, a group of about
GATHER_NUMEL elements at a time, so a rank never holds the whole model beside its EMA.
"""

from __future__ import annotations

import contextlib

import torch

GATHER_NUMEL = 1 << 26  # 256 MiB of fp32 gathered at once at most (one parameter more when it alone is larger)


class HostEMA:
    def __init__(self, named_params, decay: float, warmup: bool, zero3: bool):
        self.decay, self.warmup, self.zero3 = float(decay), bool(warmup), zero3
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {}
        for group in self._groups(list(named_params)):
            with self._gathered([p for _, p in group]):
                self.shadow.update({n: p.detach().to("cpu", torch.float32, copy=True) for n, p in group})

    def current_decay(self) -> float:
        """Warm-up: early averages forget fast, so the EMA does not stay anchored to the random init."""
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, named_params) -> None:
        d = self.current_decay()
        for group in self._groups(list(named_params)):
            with self._gathered([p for _, p in group]):
                for name, p in group:
                    self.shadow[name].lerp_(p.detach().to("cpu", torch.float32), 1.0 - d)
        self.updates += 1

    def _groups(self, named_params: list) -> list[list]:
        if not self.zero3:
            return [named_params]
        groups: list[list] = [[]]
        size = 0
        for name, p in named_params:
            numel = int(getattr(p, "ds_numel", p.numel()))
            if groups[-1] and size + numel > GATHER_NUMEL:
                groups.append([])
                size = 0
            groups[-1].append((name, p))
            size += numel
        return groups

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

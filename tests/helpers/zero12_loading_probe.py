"""Build a ZeRO-2 optimizer on the CPU accelerator over K parameter groups and print, as JSON, the most bytes
alive while DeepSpeedZeroOptimizer.__init__ takes the groups (from the first group's empty_cache to
initialize_optimizer_states), counted at each op's outputs and at each storage's death. Run as a process of its
own (it starts torch.distributed): python -m tests.helpers.zero12_loading_probe K DTYPE PORT"""

from __future__ import annotations

import json
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# parameters of unequal sizes, with one of 1 element and one of 7 (odd sizes pad differently per group)
SHAPES = [(1000, 1000), (3000,), (500, 2000), (4000, 300), (7,), (2000, 1000), (300, 300), (1,), (640, 320)]


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU storages alive. A storage is counted when an op returns it, dropped when it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.counting = False

    def add(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.mark()
        weakref.finalize(storage, self.drop, key)

    def drop(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def mark(self) -> None:
        if self.counting:
            self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.add(t)
        return out


def main(groups: int, dtype: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.runtime.zero import stage_1_and_2

    from zerotune.models.param_groups import layout

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in SHAPES])
    module = module.to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]))
    params = list(module.parameters())
    cut = layout([[p.numel() for p in params]], groups)[0]
    param_groups, start = [], 0
    for n in cut:
        param_groups.append({"params": params[start:start + n]})
        start += n
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}
    live = LiveBytes()
    for p in params:
        live.add(p.data)
    init_states = stage_1_and_2.DeepSpeedZeroOptimizer.initialize_optimizer_states

    def empty_cache() -> None:  # each group's start (line 449): from the first one on, count
        live.counting = True
        live.mark()

    def until_states(self, *args, **kwargs):  # after the loop over the groups
        live.counting = False
        return init_states(self, *args, **kwargs)

    stage_1_and_2.empty_cache = empty_cache
    stage_1_and_2.DeepSpeedZeroOptimizer.initialize_optimizer_states = until_states
    with live:
        deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(param_groups, lr=1e-3), config=config)
    print(json.dumps({"peak_bytes": live.peak, "groups": [[p.numel() for p in g["params"]] for g in param_groups]}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])

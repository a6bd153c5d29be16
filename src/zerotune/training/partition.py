"""What one rank holds of the model's training state, read from the DeepSpeed engine itself.

ZeRO partitions, per stage: 1, the fp32 master weights and the optimizer states; 2, + the gradients;
3, + the parameters. `partition_bytes` reports this rank's share of each, in bytes:

- params_bytes: the parameter storage. Stages 0-2: every rank holds all of it. Stage 3: the rank's
  partitions (`param.ds_tensor`), plus the whole tensor of parameters DeepSpeed keeps persistent
  (smaller than `stage3_param_persistence_threshold`: those are replicated on purpose).
- grads_bytes: the gradient storage that survives between backward and step. Stages 0-1: whole
  gradients. Stage 2: the rank's flat partition (`partition_size`). Stage 3: the flat buffer of
  gradient partitions (`grad_partitions_flat_buffer`).
- master_weights_bytes: the fp32 copy the optimizer updates (`single_partition_of_fp32_groups`,
  `fp32_partitioned_groups_flat`); 0 where the optimizer updates the parameters themselves
  (stage 0 in fp32).
- optimizer_state_bytes: the tensors in the inner torch optimizer's state (Adam's two moments, ...).

Partitions are padded for alignment (stages 1-2: each flat group to a multiple of the world size
times a small alignment; stage 3: each parameter to a multiple of the world size), so a rank's share
is its exact fraction plus at most a few elements per tensor or group.
"""

from __future__ import annotations

from typing import Any

import torch


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Each storage once: bitsandbytes' 8-bit states all point at one pair of quantisation maps."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr() or id(v)] = _nbytes(v)
    return sum(seen.values())


def partition_bytes(model: Any, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """This rank's bytes of parameters, gradients, fp32 master weights and optimizer states.

    `model` is the DeepSpeed engine (accelerate's prepared model is that engine). Without DeepSpeed
    (plain accelerate), pass the optimizer too: nothing is partitioned then.
    """
    from deepspeed import DeepSpeedEngine

    if not isinstance(model, DeepSpeedEngine):
        module = getattr(model, "module", model)
        params = [p for p in module.parameters()]
        whole = sum(_nbytes(p) for p in params)
        return {"zero_stage": 0, "world_size": _world(), "params_bytes": whole,
                "grads_bytes": sum(_nbytes(p) for p in params if p.requires_grad),
                "master_weights_bytes": 0,
                "optimizer_state_bytes": _state_bytes(optimizer) if optimizer is not None else 0}
    stage = int(model.zero_optimization_stage())
    params = list(model.module.parameters())
    share = {3: _zero3_share, 1: _zero12_share, 2: _zero12_share}.get(stage, _stage0_share)
    params_bytes, grads_bytes, master, state = share(model.optimizer, params, stage)
    return {"zero_stage": stage, "world_size": _world(), "params_bytes": params_bytes, "grads_bytes": grads_bytes,
            "master_weights_bytes": master, "optimizer_state_bytes": state}


def _elem(params: list) -> int:
    trainable = [p for p in params if p.requires_grad]
    return trainable[0].element_size() if trainable else 4


def _zero3_share(zopt: Any, params: list, stage: int) -> tuple[int, int, int, int]:
    trainable = [p for p in params if p.requires_grad]
    params_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                       + (p.ds_numel * p.element_size() if getattr(p, "ds_persist", False) else 0) for p in params)
    flat = getattr(zopt, "grad_partitions_flat_buffer", None)
    grads_bytes = _nbytes(flat) if flat is not None else sum(p.partition_numel() * _elem(params) for p in trainable)
    master = sum(_nbytes(t) for t in zopt.fp32_partitioned_groups_flat)
    return params_bytes, grads_bytes, master, _state_bytes(zopt.optimizer)


def _zero12_share(zopt: Any, params: list, stage: int) -> tuple[int, int, int, int]:
    elem = _elem(params)
    master = sum(_nbytes(t) for t in zopt.single_partition_of_fp32_groups)
    grads_bytes = (sum(int(n) for n in zopt.partition_size) * elem if stage == 2
                   else sum(p.numel() * elem for p in params if p.requires_grad))
    return sum(_nbytes(p) for p in params), grads_bytes, master, _state_bytes(zopt.optimizer)


def _stage0_share(zopt: Any, params: list, stage: int) -> tuple[int, int, int, int]:
    inner = getattr(zopt, "optimizer", zopt)  # bf16/fp16 wrappers hold the torch optimizer
    own = {id(p) for p in params}
    master = sum(_nbytes(p) for g in inner.param_groups for p in g["params"] if id(p) not in own)
    grads_bytes = sum(p.numel() * _elem(params) for p in params if p.requires_grad)
    return sum(_nbytes(p) for p in params), grads_bytes, master, _state_bytes(inner)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

"""Per-rank bytes of the model states (parameters, gradients, fp32 master weights, optimizer states) a run
will hold, predicted from the parameter sizes and the validated DeepSpeed dict, with no weights built.

The keys are the ones `training/partition.py::partition_bytes` reads from the live engine after step 1,
and the rules are DeepSpeed 0.19.8's own (runtime/zero/stage_1_and_2.py, stage3.py,
partition_parameters.py, parameter_offload.py), padding included:

- stages 1-2: the optimizer's (trainable) parameters form one flat group padded to a multiple of
  nccl_start_alignment_factor (2) x world size; each rank owns `flat // world` elements of it
  (master weights, optimizer states and, at stage 2, gradients). Frozen parameters (an adapter's base
  U-Net) are no part of it: ordinary module parameters, whole on every rank, in the engine's dtype.
- stage 3: each module parameter, frozen ones included, is padded to a multiple of the world size and
  split evenly (`ds_tensor`); parameters of at most `stage3_param_persistence_threshold` elements are also
  kept whole. Gradients of the trainable ones live in one flat buffer of their partitions; master weights
  and optimizer states per sub-group of the trainable partitions.
- stage 0 / plain accelerate: nothing is partitioned; gradients and optimizer of the trainable ones.

Every function takes `param_numels` (all of `unet.parameters()`, in order) and `trainable_numels` (those
the optimizer gets, in the same order; None: all of them, as without an adapter).

`deepspeed_buffer_bytes` (DeepSpeed's own buffers on top of these) lives in buffers.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FP32_STEP_BYTES = 4  # torch optimizers keep `step` as a 0-d float32 tensor per optimized tensor
_ELEM = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Precision:
    """Element sizes (bytes) of what the engine holds, from the dict's fp16/bf16/data_types blocks."""

    name: str        # fp32 | bf16 | fp16: the parameters' dtype
    param: int
    grad_accum: int  # data_types.grad_accum_dtype, else the parameters' dtype (engine.get_data_types)
    master: int      # fp32 unless {fp16,bf16}_master_weights_and_grads
    bf16_optimizer_states: bool


@dataclass(frozen=True)
class OptimizerKind:
    """The optimizer class DeepSpeed builds (engine._configure_basic_optimizer) and what its state holds."""

    name: str
    tensors: int           # state tensors per optimized tensor, each of its size
    state_elem: int        # bytes per element of those tensors
    torch_step: bool       # torch's own optimizers add a 0-d float32 `step` tensor


def dtype_bytes(value: Any) -> int:
    """Bytes per element of a dtype as the DeepSpeed dict spells it (fp32, "torch.bfloat16", "half", ...)."""
    from deepspeed.runtime.config import DtypeEnum

    return _ELEM[DtypeEnum(value).name]


def precision_of(ds_config: dict) -> Precision:
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    bf16, fp16 = get_bfloat16_config(ds_config), get_float16_config(ds_config)
    name = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    master = ("fp16" if fp16.fp16_master_weights_and_grads else
              "bf16" if bf16.bf16_master_weights_and_grads else "fp32")
    return Precision(name, _ELEM[name], dtype_bytes(accum) if accum else _ELEM[name], _ELEM[master],
                     bool(bf16.bf16_optimizer_states))


def zero_config(ds_config: dict):
    """DeepSpeed's own parse of `zero_optimization`: its defaults and aliases (stage3_* names, overlap_comm)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))


def offload_device(block: Any) -> str:
    device = getattr(block, "device", None) if block is not None else None
    return "none" if device is None else str(getattr(device, "value", device))


def _place(device: str) -> str:
    """Where an offload device puts a tensor: cpu -> host memory; nvme -> swap files (pinned host buffers)."""
    return {"none": "gpu", "cpu": "host"}.get(device, device)


def optimizer_kind(ds_config: dict, offloaded: bool, prec: Precision, plain: bool = False) -> OptimizerKind:
    opt = ds_config.get("optimizer") or {}
    name, params = str(opt.get("type", "adamw")).lower(), opt.get("params") or {}
    if name in ("adam", "adamw"):
        if plain or params.get("torch_adam"):
            return OptimizerKind("torch.optim.AdamW", 2, prec.master, True)
        if offloaded:  # fp32 moments unless bf16_optimizer_states (engine.get_optimizer_configuration)
            fp32 = params.get("fp32_optimizer_states", True) and not prec.bf16_optimizer_states
            return OptimizerKind("DeepSpeedCPUAdam", 2, 4 if fp32 else prec.master, False)
        return OptimizerKind("FusedAdam", 2, prec.master, False)
    cpu_elem = 4 if params.get("fp32_optimizer_states", True) else prec.master
    if name == "adagrad":
        return (OptimizerKind("DeepSpeedCPUAdagrad", 1, cpu_elem, False) if offloaded and not plain
                else OptimizerKind("torch.optim.Adagrad", 1, prec.master, True))
    if name == "lion":  # CPU Lion allocates an exp_avg_sq it never uses (ops/lion/cpu_lion.py:step)
        return (OptimizerKind("DeepSpeedCPULion", 2, cpu_elem, False) if offloaded
                else OptimizerKind("FusedLion", 1, prec.master, False))
    if name == "lamb":
        return OptimizerKind("FusedLamb", 2, prec.master, False)
    if name in ("muadam", "muadamw"):
        return OptimizerKind(f"mup.{name}", 2, prec.master, True)
    if name == "musgd":
        return OptimizerKind("mup.MuSGD", 1 if params.get("momentum") else 0, prec.master, False)
    raise ValueError(f"no memory rule for optimizer {opt.get('type')!r}")


def _state(kind: OptimizerKind, elements: int, tensors: int) -> int:
    """Optimizer state bytes for `tensors` optimized tensors holding `elements` elements in all."""
    return kind.tensors * elements * kind.state_elem + (FP32_STEP_BYTES * tensors if kind.torch_step else 0)


def zero12_flat(numels: list[int], world: int, parameter_alignment: bool, param_elem: int) -> int:
    """Elements of the padded flat group (DeepSpeedZeroOptimizer.__init__): per-parameter padding when
    zero_optimization.parameter_alignment, then DeepSpeed's own get_alignment_padding to 2 x world."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import get_alignment_padding

    align = 16 // math.gcd(16, param_elem) if parameter_alignment else 1
    padded = sum(numels) + sum((-n) % align for n in numels[:-1])
    nccl_start_alignment_factor = 2  # DeepSpeedZeroOptimizer.__init__: 4-byte alignment / sizeof(fp16)
    return padded + get_alignment_padding([torch.empty(padded, device="meta")], nccl_start_alignment_factor * world)


def stage3_partition_numel(numel: int, world: int) -> int:
    # Init._padding_size / _partition_param (partition_parameters.py), by hand: they are methods of a live
    # zero.Init context. Each tensor is padded to a multiple of the world size and split evenly.
    return (numel + (-numel) % world) // world


def stage3_persistent(numels: list[int], zero: Any) -> list[bool]:
    """DeepSpeedZeRoOffload.mark_persistent_parameters: small parameters stay whole, up to a model total."""
    out, total = [], 0
    for n in numels:
        keep = n + total <= zero.model_persistence_threshold and n <= zero.param_persistence_threshold
        total += n if keep else 0
        out.append(keep)
    return out


def stage3_sub_groups(partition_numels: list[int], sub_group_size: int) -> list[int]:
    """Elements per sub-group (DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups)."""
    if sub_group_size is None or sub_group_size >= sum(partition_numels):
        return [sum(partition_numels)]
    groups, size = [], 0
    for i, n in enumerate(partition_numels):
        size += n
        if size >= sub_group_size or i == len(partition_numels) - 1:
            groups.append(size)
            size = 0
    return groups


def _result(stage: int, world: int, rank: int, params: int, grads: int, master: int, state: int, **extra) -> dict:
    where = extra.pop("where")
    return {"zero_stage": stage, "world_size": world, "rank": rank, "params_bytes": params, "grads_bytes": grads,
            "master_weights_bytes": master, "optimizer_state_bytes": state, "where": where,
            "grads_on_gpu": where["grads"] == "gpu", **extra}


def _plain(numels: list[int], train: list[int], ds: dict, world: int, rank: int) -> dict:
    # Plain accelerate keeps fp32 weights (autocast for bf16/fp16) and builds torch's optimizer on them.
    prec = Precision("fp32", 4, 4, 4, False)
    kind, trained = optimizer_kind(ds, False, prec, plain=True), sum(train)
    return _result(0, world, rank, sum(numels) * 4, trained * 4, 0, _state(kind, trained, len(train)),
                   where=dict.fromkeys(("params", "grads", "master_weights", "optimizer_state"), "gpu"),
                   elem_bytes={"params": 4, "grads": 4, "master_weights": 4, "optimizer_state": kind.state_elem},
                   optimizer=kind.name, params_persistent_bytes=0, master_weights_alias_params=False,
                   trainable_params_bytes=trained * 4)


def _stage0(numels: list[int], train: list[int], ds: dict, world: int, rank: int, prec: Precision) -> dict:
    kind, trained = optimizer_kind(ds, False, prec), sum(train)
    if prec.name == "fp32":  # the basic optimizer steps the parameters themselves
        master, tensors = 0, len(train)
    else:  # FP16_Optimizer (FusedAdam: one flat fp32 copy) or FP16_UnfusedOptimizer (an fp32 copy per tensor)
        master, tensors = trained * 4, 1 if kind.name == "FusedAdam" else len(train)
    kind = OptimizerKind(kind.name, kind.tensors, 4, kind.torch_step)  # the updated tensors are fp32 here
    return _result(0, world, rank, sum(numels) * prec.param, trained * prec.param, master,
                   _state(kind, trained, tensors),
                   where=dict.fromkeys(("params", "grads", "master_weights", "optimizer_state"), "gpu"),
                   elem_bytes={"params": prec.param, "grads": prec.param, "master_weights": 4,
                               "optimizer_state": kind.state_elem},
                   optimizer=kind.name, params_persistent_bytes=0, master_weights_alias_params=False,
                   trainable_params_bytes=trained * prec.param)


def _zero12(numels: list[int], train: list[int], ds: dict, world: int, rank: int, prec: Precision,
            zero: Any) -> dict:
    stage, trained = int(zero.stage), sum(train)
    opt_dev = offload_device(zero.offload_optimizer)
    kind = optimizer_kind(ds, opt_dev != "none", prec)
    part = zero12_flat(train, world, zero.parameter_alignment, prec.param) // world
    grads = part * prec.param if stage == 2 else trained * prec.param
    host = "host" if opt_dev != "none" else "gpu"  # DeepSpeed offloads stages 1-2 to the CPU only
    # params: the flat group's views and the frozen parameters, each whole (stage_1_and_2.py only
    # flattens the optimizer's param_groups)
    return _result(stage, world, rank, sum(numels) * prec.param, grads, part * prec.master, _state(kind, part, 1),
                   where={"params": "gpu", "grads": host if stage == 2 else "gpu", "master_weights": host,
                          "optimizer_state": host},
                   elem_bytes={"params": prec.param, "grads": prec.param, "master_weights": prec.master,
                               "optimizer_state": kind.state_elem},
                   optimizer=kind.name, params_persistent_bytes=0, master_weights_alias_params=False,
                   partition_numel=part, trainable_params_bytes=trained * prec.param)


def _stage3(numels: list[int], train: list[int], ds: dict, world: int, rank: int, prec: Precision,
            zero: Any) -> dict:
    opt_dev, param_dev = offload_device(zero.offload_optimizer), offload_device(zero.offload_param)
    kind = optimizer_kind(ds, opt_dev != "none", prec)
    # zero.Init partitions every module parameter (parameter_offload.py:_convert_to_zero_parameters) and
    # marks persistence over all of them; the optimizer's partitions are the trainable ones'.
    every = sum(stage3_partition_numel(n, world) for n in numels)
    persist = sum(n for n, keep in zip(numels, stage3_persistent(numels, zero), strict=True) if keep)
    parts = [stage3_partition_numel(n, world) for n in train]
    part, groups = sum(parts), stage3_sub_groups(parts, zero.sub_group_size)
    host = _place(opt_dev)
    return _result(3, world, rank, (every + persist) * prec.param, part * prec.grad_accum, part * prec.master,
                   _state(kind, part, len(groups)),
                   # the gradient partitions sit on the optimizer's device: host memory even for NVMe
                   where={"params": _place(param_dev), "grads": "gpu" if opt_dev == "none" else "host",
                          "master_weights": host, "optimizer_state": host},
                   elem_bytes={"params": prec.param, "grads": prec.grad_accum, "master_weights": prec.master,
                               "optimizer_state": kind.state_elem},
                   optimizer=kind.name, params_persistent_bytes=persist * prec.param,
                   # fp32 without offload: the "master" partitions are the parameter partitions themselves
                   master_weights_alias_params=opt_dev == "none" and param_dev == "none" and prec.param == prec.master,
                   partition_numel=part, sub_groups=len(groups), trainable_params_bytes=part * prec.param)


def trainable_or_all(param_numels: list[int], trainable_numels: list[int] | None) -> list[int]:
    return [int(n) for n in (param_numels if trainable_numels is None else trainable_numels)]


def model_state_bytes(param_numels: list[int], ds_config: dict, world_size: int, rank: int,
                      use_deepspeed: bool, trainable_numels: list[int] | None = None) -> dict:
    """This rank's bytes of parameters, gradients, master weights and optimizer states, as
    `partition_bytes` will read them after step 1, with where each lives (`where`: gpu | host) and the
    element sizes. `param_numels`: every parameter's size in model.parameters() order; `trainable_numels`:
    the optimizer's (same order; None: all). `trainable_params_bytes`: what of `params_bytes` the
    optimizer updates (whole at stages 0-2, this rank's partitions at stage 3)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    numels, train = [int(n) for n in param_numels], trainable_or_all(param_numels, trainable_numels)
    if not use_deepspeed:
        return _plain(numels, train, ds_config, world_size, rank)
    zero, prec = zero_config(ds_config), precision_of(ds_config)
    stage = int(zero.stage)
    if stage == 0:
        return _stage0(numels, train, ds_config, world_size, rank, prec)
    if stage == 1 and prec.name == "bf16" and prec.grad_accum == 4 and offload_device(zero.offload_optimizer) == "none":
        # engine._do_optimizer_sanity_check picks BF16_Optimizer here: the same flat partition rule as
        # stage 1 for master and states, but whole fp32 gradients (bf16_optimizer.py:_setup_for_real_optimizer).
        out = _zero12(numels, train, ds_config, world_size, rank, prec, zero)
        return {**out, "grads_bytes": zero12_flat(train, world_size, False, 2) * 4}
    if stage in (1, 2):
        return _zero12(numels, train, ds_config, world_size, rank, prec, zero)
    return _stage3(numels, train, ds_config, world_size, rank, prec, zero)


def deepspeed_buffer_bytes(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                           rank: int | None = None, use_deepspeed: bool = True,
                           trainable_numels: list[int] | None = None) -> dict:
    """DeepSpeed's own GPU buffers on top of the model states, {name: bytes} ({} without DeepSpeed); the
    named terms with sources, host buffers and bounds are in plan/buffers.py (`buffer_terms`)."""
    from zerotune.plan.buffers import gpu_buffer_bytes  # buffers.py builds on this module's rules

    return gpu_buffer_bytes(ds_config, param_numels, world_size, precision, rank, use_deepspeed, trainable_numels)


def param_numels(model_cfg: Any, adapter_cfg: Any = None) -> tuple[list[int], list[int]]:
    """Every parameter's size and the trainable ones' (adapter_cfg: the run's `adapter`), in
    model.parameters() order, from a meta-device build."""
    from zerotune.models import model_stats

    stats = model_stats(model_cfg, adapter_cfg)
    return list(stats.param_numels), list(stats.trainable_numels or stats.param_numels)

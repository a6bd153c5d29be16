"""ZeRO-3's rules (DeepSpeed 0.19.8's runtime/zero/stage3.py, partition_parameters.py, parameter_offload.py):
each module parameter is padded to a multiple of the world size and split evenly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerotune.plan import allocator, encoders
from zerotune.plan.gpus import GPU
from zerotune.plan.rules import (
    Precision,
    StepShape,
    buffer_term,
    comm_elem,
    offload_device,
    optimizer_kind,
    optimizer_state,
    place,
    split_groups,
    state_mib,
    states_record,
    term,
)
from zerotune.resolved import ResolvedRun
from zerotune.rundir.plan import Term
from zerotune.schema import Config
from zerotune.units import DTYPE_BYTES, MIB

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

_SRC = "runtime/zero/stage3.py:DeepSpeedZeroOptimizer_Stage3."


def stage3_partition_numel(numel: int, world: int) -> int:
    # Init._padding_size / _partition_param (partition_parameters.py), by hand: they are methods of a live
    # zero.Init context. Each tensor is padded to a multiple of the world size and split evenly.
    return (numel + (-numel) % world) // world


def stage3_persistent(numels: list[int], zero: DeepSpeedZeroConfig) -> list[bool]:
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


def states(numels: list[int], train: list[int], ds: dict, world: int, prec: Precision,
           zero: DeepSpeedZeroConfig, client: dict | None = None, shapes: list[tuple[int, ...]] | None = None,
           groups: list[int] | None = None) -> dict:
    """`shapes` is not read: the optimizer steps one flat 1-D tensor per sub-group of each parameter group."""
    opt_dev, param_dev = offload_device(zero.offload_optimizer), offload_device(zero.offload_param)
    kind = optimizer_kind(ds, opt_dev != "none", prec, client=client)
    # zero.Init partitions every module parameter (parameter_offload.py:_convert_to_zero_parameters) and
    # marks persistence over all of them; the optimizer's partitions are the trainable ones'.
    every = sum(stage3_partition_numel(n, world) for n in numels)
    persist = sum(n for n, keep in zip(numels, stage3_persistent(numels, zero), strict=True) if keep)
    parts = [stage3_partition_numel(n, world) for n in train]
    part, subs = sum(parts), _sub_groups(parts, zero.sub_group_size, groups)
    host = place(opt_dev)
    return states_record((every + persist) * prec.param, part * prec.grad_accum, part * prec.master,
                         optimizer_state(kind, [(g,) for g in subs]), (prec.param, prec.grad_accum, prec.master), kind,
                         part * prec.param,
                         # the gradient partitions sit on the optimizer's device: host memory even for NVMe
                         where={"params": place(param_dev), "grads": "gpu" if opt_dev == "none" else "host",
                                "master_weights": host, "optimizer_state": host},
                         params_persistent_bytes=persist * prec.param,
                         # fp32 without offload: the "master" partitions are the parameter partitions themselves
                         master_weights_alias_params=opt_dev == "none" and param_dev == "none" and prec.param == prec.master,
                         partition_numel=part, sub_groups=len(subs))


def _sub_groups(parts: list[int], sub_group_size: int, groups: list[int] | None) -> list[int]:
    """stage3.py _create_fp16_sub_groups, per parameter group: sub-groups never span two groups."""
    return [size for group in split_groups(parts, groups) for size in stage3_sub_groups(group, sub_group_size)]


def _aio_aligned(numel: int, elem: int, ds: dict) -> int:
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.swap_tensor.constants import AIO_INTRA_OP_PARALLELISM
    from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES

    align = AIO_ALIGNED_BYTES * get_aio_config(ds)[AIO_INTRA_OP_PARALLELISM] // elem
    return numel + (-numel) % align


def buffers(ds: dict, numels: list[int], train: list[int], world: int, rank: int | None, prec: Precision,
            zero: DeepSpeedZeroConfig, groups: list[int] | None = None) -> list[Term]:
    src, opt_dev, param_dev = _SRC, offload_device(zero.offload_optimizer), offload_device(zero.offload_param)
    parts = [stage3_partition_numel(n, world) for n in train]  # the optimizer's partitions
    largest = max(_sub_groups(parts, zero.sub_group_size, groups))
    persist = stage3_persistent(numels, zero)
    # every module parameter (frozen ones too) is all-gathered for forward and backward, at padded size
    gathered = sum(stage3_partition_numel(n, world) * world for n, keep in zip(numels, persist, strict=True)
                   if not keep)
    coord = "runtime/zero/partitioned_param_coordinator.py:PartitionedParameterCoordinator.fetch_sub_module"
    terms = [buffer_term("stage3_live_params", min(zero.max_live_parameters, gathered) * prec.param, "gpu", "upper",
                         "forward+backward", coord + " (cap on gathered parameters; the running module is fetched "
                         "even past it)"),
             buffer_term("stage3_prefetch_bucket", min(zero.prefetch_bucket_size, gathered) * prec.param, "gpu",
                         "upper", "forward+backward", coord + " (prefetch, inside the live-parameter cap)",
                         "stage3_live_params")]
    if zero.contiguous_gradients:
        terms.append(buffer_term("ipg_bucket", zero.reduce_bucket_size * comm_elem(ds, prec.param), "gpu", "exact",
                                 "persistent", src + "_setup_for_real_optimizer (one buffer, overlap_comm or not)"))
    if opt_dev == "none":
        cast = prec.master if prec.master != prec.grad_accum else 0
        terms.append(buffer_term("step_fp32_grad_sub_group", largest * (prec.grad_accum + cast), "gpu", "upper",
                                 "step:flatten", src + "_prepare_fp32_grad_for_sub_group (flatten, then cast to the "
                                 "master dtype)"))
    if opt_dev == "cpu":
        terms.append(buffer_term("offload_fp32_grad_partition", sum(parts) * prec.master, "host", "exact", "persistent",
                                 src + "initialize_optimizer_states (subgroup_gradient_buffer, pinned)"))
    if param_dev != "none":
        terms.append(buffer_term("offload_param_flat", sum(parts) * prec.param, "host", "exact", "persistent",
                                 src + "_create_param_groups_fp16_flat_cpu_memory (pinned)", "params_bytes"))
    if param_dev == "nvme":
        block = zero.offload_param
        terms.append(buffer_term("nvme_param_swap_buffers", block.buffer_count * _aio_aligned(
            block.buffer_size, prec.param, ds) * prec.param, "host", "exact", "persistent",
            "runtime/swap_tensor/partitioned_param_swapper.py:AsyncPartitionedParameterSwapper.__init__"))
    if opt_dev == "nvme":
        terms.append(buffer_term("nvme_optimizer_swap_buffers", zero.offload_optimizer.buffer_count * _aio_aligned(
            largest, prec.master, ds) * prec.master, "host", "upper", "persistent",
            "runtime/swap_tensor/optimizer_utils.py:OptimizerSwapper.__init__ (SwapBufferManager)"))
    return terms


def step_transients(shape: StepShape) -> list[dict]:
    if not shape.use_deepspeed or shape.offloaded:
        return []
    return [term("step_fp32_grad_sub_group", shape.largest_trained * shape.master_elem,
                 _SRC + "_prepare_fp32_grad_for_sub_group (the sub-group's fp32 gradient)", "step:update")]


def loading(cfg: Config, checked: ResolvedRun, gpu: GPU | None, plan: dict, base: list[dict]) -> dict:
    """ZeRO-3: zero.Init builds each module on the GPU in fp32 and casts it (partition_parameters.py
    zero_wrapper_for_fp_tensor_constructor), then keeps this rank's partition; the optimizer moves the partitions
    to the host, empties the cache and copies them back as one flat buffer (runtime/zero/utils.py defragment,
    line 234); without optimizer offload the fp32 master is `.to(device, fp32).clone()` of each sub-group
    (stage3.py _create_fp32_partitions, line 1170): one sub-group's fp32 copy is transient."""
    elem = DTYPE_BYTES[cfg.precision.name]
    params = (state_mib(plan, "params") + state_mib(plan, "params_persistent")) * MIB
    master = state_mib(plan, "master_weights") * MIB
    module = encoders.largest_module_numel(cfg.model, cfg.adapter)
    build = allocator.reserved_bytes([module * elem, module * 4])
    sub = int(checked.ds_config["zero_optimization"].get("sub_group_size", 1_000_000_000))
    transient = min(master, sub * 4) if master else 0
    terms = [*base, term("params_partitions", params, "this rank's flat partition (the step's params terms)"),
             term("master_weights", master, "fp32 partition on the GPU (the step's term)" if master else
                  "on the host (the step's term)"),
             term("loading_transient", max(build, transient),
                  f"the larger of: one module built whole, fp32 then {cfg.precision.name} ({module:,} elements, "
                  f"{build / MIB:,.1f} MiB), and one fp32 sub-group copy ({transient / MIB:,.1f} MiB)")]
    end = sum(t["mib"] for t in base) + (params + master + transient) / MIB  # the build's blocks were released
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms, "end_live_mib": end,
            "source": "partition_parameters.py zero.Init; runtime/zero/utils.py defragment empties the cache "
                      "(line 234) before the fp32 partitions are made"}

"""ZeRO-1 and ZeRO-2's rules (DeepSpeed 0.19.8's runtime/zero/stage_1_and_2.py): the optimizer's parameters form
one flat group padded to 2 x world size, each rank owning `flat // world` elements of it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from zerotune.plan import allocator
from zerotune.plan.gpus import GPU
from zerotune.plan.rules import (
    Precision,
    StepShape,
    buffer_term,
    module_blocks,
    offload_device,
    offload_devices,
    optimizer_kind,
    optimizer_state,
    split_groups,
    state_mib,
    states_record,
    term,
)
from zerotune.resolved import ResolvedRun
from zerotune.rundir.plan import Term
from zerotune.schema import Config, launch_world_size
from zerotune.units import DTYPE_BYTES, MIB

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

_NORM_BYTES = 8  # zero/utils.py:get_norm_dtype: fp64 on every device that has it (CUDA does)


_S12 = "runtime/zero/stage_1_and_2.py"


def zero12_flat(numels: list[int], world: int, parameter_alignment: bool, param_elem: int) -> int:
    """Elements of the padded flat group (DeepSpeedZeroOptimizer.__init__): per-parameter padding when
    zero_optimization.parameter_alignment, then DeepSpeed's own get_alignment_padding to 2 x world."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import get_alignment_padding

    align = 16 // math.gcd(16, param_elem) if parameter_alignment else 1
    padded = sum(numels) + sum((-n) % align for n in numels[:-1])
    nccl_start_alignment_factor = 2  # DeepSpeedZeroOptimizer.__init__: 4-byte alignment / sizeof(fp16)
    return padded + get_alignment_padding([torch.empty(padded, device="meta")], nccl_start_alignment_factor * world)


def states(numels: list[int], train: list[int], ds: dict, world: int, prec: Precision,
           zero: DeepSpeedZeroConfig, client: dict | None = None, shapes: list[tuple[int, ...]] | None = None,
           groups: list[int] | None = None) -> dict:
    """`shapes` is not read: the optimizer steps one flat 1-D partition per parameter group (`groups`)."""
    stage, trained = int(zero.stage), sum(train)
    opt_dev = offload_device(zero.offload_optimizer)
    kind = optimizer_kind(ds, opt_dev != "none", prec, client=client)
    parts = [zero12_flat(g, world, zero.parameter_alignment, prec.param) // world for g in split_groups(train, groups)]
    part = sum(parts)
    grads = part * prec.param if stage == 2 else trained * prec.param
    if stage == 1 and prec.name == "bf16" and prec.grad_accum == 4 and opt_dev == "none":
        # engine._do_optimizer_sanity_check picks BF16_Optimizer here: the same flat partition rule as
        # stage 1 for master and states, but whole fp32 gradients (bf16_optimizer.py:_setup_for_real_optimizer).
        grads = sum(zero12_flat(g, world, False, 2) for g in split_groups(train, groups)) * 4
    host = "host" if opt_dev != "none" else "gpu"  # DeepSpeed offloads stages 1-2 to the CPU only
    # params: the flat group's views and the frozen parameters, each whole (stage_1_and_2.py only
    # flattens the optimizer's param_groups)
    return states_record(sum(numels) * prec.param, grads, part * prec.master, optimizer_state(kind, [(p,) for p in parts]),
                         (prec.param, prec.param, prec.master), kind, trained * prec.param,
                         where={"params": "gpu", "grads": host if stage == 2 else "gpu", "master_weights": host,
                                "optimizer_state": host}, partition_numel=part)


def _overlap_partition(numels: list[int], part: int, rank: int) -> int:
    """Elements of the whole parameters that touch `rank`'s partition (get_partition_info)."""
    start, end, index, total = part * rank, part * (rank + 1), 0, 0
    for n in numels:
        if start <= index < end or index < start < index + n:
            total += n
        index += n
    return total


def buffers(ds: dict, numels: list[int], train: list[int], world: int, rank: int | None, prec: Precision,
            zero: DeepSpeedZeroConfig, groups: list[int] | None = None) -> list[Term]:
    stage, offload = int(zero.stage), offload_device(zero.offload_optimizer) != "none"
    flat = sum(zero12_flat(g, world, zero.parameter_alignment, prec.param) for g in split_groups(train, groups))
    part, largest, src = flat // world, max(train, default=0), "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer."
    accum_attr = stage == 1 and prec.grad_accum != prec.param  # use_grad_accum_attribute
    terms = [buffer_term("flat_group_padding", (flat - sum(train)) * prec.param, "gpu", "exact", "persistent",
                   src + "__init__ (flatten_dense_tensors_aligned)"),
             buffer_term("allgather_bucket", 0, "gpu", "exact", "step", "runtime/utils.py:all_gather_dp_groups (gathers "
                   "into the flat group in place; allgather_bucket_size only shards the legacy path)")]
    if zero.contiguous_gradients or offload:  # CPU offload forces contiguous gradients
        terms.append(buffer_term("ipg_bucket", zero.reduce_bucket_size * (prec.grad_accum if accum_attr else prec.param)
                           * (2 if zero.overlap_comm else 1), "gpu", "exact", "backward",
                           src + "setup_buckets (doubled with overlap_comm)"))
    if offload:
        terms += [buffer_term("offload_fp32_grad_partition", part * prec.master, "host", "exact", "persistent",
                        src + "initialize_optimizer_states (pinned)", "grads_bytes" if stage == 2 else ""),
                  buffer_term("offload_bit16_param_partition", part * prec.param, "host", "exact", "persistent",
                        src + "__init__ (param_buffer_of_bit16_for_cpu_offload_groups, pinned)"),
                  buffer_term("offload_temp_grad_host", largest * prec.param, "host", "exact", "persistent",
                        src + "__init__ (temp_grad_buffer_for_cpu_offload, pinned)"),
                  buffer_term("offload_temp_grad_gpu", largest * prec.param, "gpu", "exact", "persistent",
                        src + "__init__ (temp_grad_buffer_for_gpu_offload)"),
                  # One parameter at a time, so the largest one sets it; `upper` because it may fall where
                  # the activations are not at their peak.
                  buffer_term("offload_grad_norm_fp64", largest * _NORM_BYTES, "gpu", "upper", "backward",
                        src + "set_norm_for_param_grad_in_gpu / copy_grads_in_partition (each gradient "
                        "cast to fp64, zero/utils.py:get_norm_dtype, for its norm)")]
        return terms
    if stage == 2 and zero.contiguous_gradients and prec.grad_accum == 4 and prec.param != 4:
        # _use_compact_grad_partition_buffer
        terms.append(buffer_term("compact_grad_partition", part * 4, "gpu", "exact", "backward",
                                 src + "_build_compact_grad_partition_buffer"))
    elif stage == 2 and zero.contiguous_gradients:
        held = max(_overlap_partition(train, part, r) for r in (range(world) if rank is None else [rank]))
        terms.append(buffer_term("contiguous_gradients", held * prec.param, "gpu", "exact" if rank is not None
                                 else "upper", "backward", src + "copy_grads_in_partition (grads_in_partition: "
                                 "whole parameters touching the rank's partition)", "grads_bytes"))
    terms.append(buffer_term("step_fp32_grad_partition", part * prec.master, "gpu", "exact", "step:update",
                       src + "step (flattened gradient partition, cast to the master dtype; the gradients freed)"))
    return terms


def step_transients(shape: StepShape) -> list[dict]:
    if not shape.use_deepspeed or shape.offloaded:
        return []
    # DeepSpeedZeroOptimizer.step: flatten_dense_tensors_aligned(averaged_gradients), then .to(master dtype),
    # a copy only where the dtypes differ; the fp32 partition itself is buffers.py's step_fp32_grad_partition.
    src = "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer.step"
    cast = shape.trained * shape.master_elem if shape.master_elem != shape.param_elem else 0
    return [term("step_flat_grad_partition", shape.trained * shape.param_elem + cast,
                 src + " (the gradients flattened" + (", then cast" if cast else "") + ")", "step:flatten")]


def loading(cfg: Config, checked: ResolvedRun, gpu: GPU | None, plan: dict, base: list[dict]) -> dict:
    """ZeRO-1/2: the parameters arrive one block each (module.to); the optimizer flattens them into one buffer,
    on the GPU when NVML's free memory holds it (stage_1_and_2.py line 453, `flatten_on_accelerator`), else after
    moving them to the host and emptying the cache (line 462); the separate blocks are then freed
    (_update_model_bit16_weights) but stay reserved. The fp32 master partition is cloned on the GPU first
    (`.detach().clone().to(device=self.device, dtype=fp32)`, line 560): a copy of the partition in the run's
    dtype, freed once converted (and moved to the host under offload)."""
    elem, world = DTYPE_BYTES[cfg.precision.name], launch_world_size(cfg.launch)
    sizes, frozen = module_blocks(checked, elem)
    flat = sum(sizes) - sum(frozen)
    separate = allocator.reserved_bytes(sizes)
    on_gpu = gpu is None or (gpu.memory_mib - sum(t["mib"] for t in base)) * MIB - separate >= flat
    offload = offload_devices(checked.ds_config)[0]
    master = state_mib(plan, "master_weights") * MIB
    clone = 0 if (elem == 4 and offload == "none") else allocator.reserved_bytes([-(-flat // world)])
    where = "no card named: taken as fitting" if gpu is None else f"{gpu.name} holds it"
    blocks = term("unet_parameter_blocks", separate, "one block per parameter, run dtype (engine.py module.to); "
                  + ("freed when the flat buffer takes them, still reserved" if on_gpu else
                     f"moved to the host, released by empty_cache() ({_S12} line 462)"))
    later = [term("flat_parameter_buffer", allocator.reserved_bytes([flat]), f"{_S12} flatten_dense_tensors_aligned"
                  + (f" on the GPU ({where})" if on_gpu else " on the host, then moved")),
             term("master_partition_clone", clone, f"{_S12} line 560: the partition cloned on the GPU before "
                  f".to(fp32, {'host' if offload != 'none' else 'GPU'})" if clone else "fp32: the clone is the master"),
             term("master_weights", master, "fp32 partition on the GPU (the step's term)" if master else
                  "on the host (the step's term)")]
    moments = [blocks, *later] if on_gpu else max([blocks], later, key=lambda ts: sum(t["mib"] for t in ts))
    terms = [*base, *moments]
    end = None if on_gpu else sum(t["mib"] for t in [*base, *later])
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms, "end_live_mib": end,
            "source": f"engine.py _configure_distributed_model; {_S12} DeepSpeedZeroOptimizer.__init__ "
                      f"(empty_cache() at line 449 before flattening releases what earlier phases left)"}

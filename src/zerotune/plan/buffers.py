"""DeepSpeed 0.19.8's own buffers, on top of the model states of model_states.py, each named with the
place in DeepSpeed's source that allocates it.

Each term says where it lives (gpu | host: pinned host memory), whether the figure is exact or an upper
bound (`bound`), when it exists (`lifetime`: persistent | backward | forward+backward | reduce (the
gradient reduction that ends backward) | step:flatten | step:update (plan/step_peak.py's moments)), and, where
the same memory is already counted as a model state, which one (`overlaps`): a planner adds only the
terms without `overlaps`. Sizes follow DeepSpeed's: only the optimizer's (trainable) parameters are
flattened, bucketed, staged and stepped; with an adapter the frozen base U-Net counts only where stage 3
gathers every module parameter for forward and backward. Nothing here can be checked on a CPU-only machine (DeepSpeed's CPU accelerator
allocates the "GPU" buffers in host memory too); the rules are read from the source.
"""

from __future__ import annotations

from typing import Any

from zerotune.plan.model_states import (
    dtype_bytes,
    model_state_bytes,
    offload_device,
    precision_of,
    stage3_partition_numel,
    stage3_persistent,
    stage3_sub_groups,
    trainable_or_all,
    zero12_flat,
    zero_config,
)

_NORM_BYTES = 8  # zero/utils.py:get_norm_dtype: fp64 on every device that has it (CUDA does)


def _term(name: str, nbytes: int, where: str, bound: str, lifetime: str, source: str, overlaps: str = "") -> dict:
    return {"name": name, "bytes": int(nbytes), "where": where, "bound": bound, "lifetime": lifetime,
            "source": source, "overlaps": overlaps}


def _comm_elem(ds: dict, param_elem: int) -> int:
    """engine.communication_data_type: the dict's value, else the parameters' dtype."""
    value = ds.get("communication_data_type")
    return dtype_bytes(value) if value else param_elem


def _stage0(ds: dict, numels: list[int], prec: Any) -> list[dict]:
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    # A bucket closes once it passes MEMORY_OPT_ALLREDUCE_SIZE elements; it is cast when the comm dtype differs.
    bucket = min(sum(numels), MEMORY_OPT_ALLREDUCE_SIZE + max(numels, default=0))
    comm = _comm_elem(ds, prec.param)
    return [_term("allreduce_flat_bucket", bucket * (prec.param + (comm if comm != prec.param else 0)), "gpu",
                  "upper", "reduce", "runtime/engine.py:DeepSpeedEngine.allreduce_no_retain / allreduce_bucket "
                  "(flattens gradients in buckets of MEMORY_OPT_ALLREDUCE_SIZE elements)")]


def _overlap_partition(numels: list[int], part: int, rank: int) -> int:
    """Elements of the whole parameters that touch `rank`'s partition (get_partition_info)."""
    start, end, index, total = part * rank, part * (rank + 1), 0, 0
    for n in numels:
        if start <= index < end or index < start < index + n:
            total += n
        index += n
    return total


def _zero12_grads(numels: list[int], part: int, world: int, rank: int | None, prec: Any) -> dict:
    if prec.grad_accum == 4 and prec.param != 4:  # _use_compact_grad_partition_buffer
        return _term("compact_grad_partition", part * 4, "gpu", "exact", "backward",
                     "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer._build_compact_grad_partition_buffer")
    ranks = range(world) if rank is None else [rank]
    held = max(_overlap_partition(numels, part, r) for r in ranks)
    return _term("contiguous_gradients", held * prec.param, "gpu", "exact" if rank is not None else "upper",
                 "backward", "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer.copy_grads_in_partition "
                 "(grads_in_partition: whole parameters touching the rank's partition)", "grads_bytes")


def _zero12(ds: dict, numels: list[int], world: int, rank: int | None, prec: Any, zero: Any) -> list[dict]:
    stage, offload = int(zero.stage), offload_device(zero.offload_optimizer) != "none"
    flat = zero12_flat(numels, world, zero.parameter_alignment, prec.param)
    part, largest, src = flat // world, max(numels, default=0), "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer."
    accum_attr = stage == 1 and prec.grad_accum != prec.param  # use_grad_accum_attribute
    terms = [_term("flat_group_padding", (flat - sum(numels)) * prec.param, "gpu", "exact", "persistent",
                   src + "__init__ (flatten_dense_tensors_aligned)"),
             _term("allgather_bucket", 0, "gpu", "exact", "step", "runtime/utils.py:all_gather_dp_groups (gathers "
                   "into the flat group in place; allgather_bucket_size only shards the legacy path)")]
    if zero.contiguous_gradients or offload:  # CPU offload forces contiguous gradients
        terms.append(_term("ipg_bucket", zero.reduce_bucket_size * (prec.grad_accum if accum_attr else prec.param)
                           * (2 if zero.overlap_comm else 1), "gpu", "exact", "backward",
                           src + "setup_buckets (doubled with overlap_comm)"))
    if offload:
        terms += [_term("offload_fp32_grad_partition", part * prec.master, "host", "exact", "persistent",
                        src + "initialize_optimizer_states (pinned)", "grads_bytes" if stage == 2 else ""),
                  _term("offload_bit16_param_partition", part * prec.param, "host", "exact", "persistent",
                        src + "__init__ (param_buffer_of_bit16_for_cpu_offload_groups, pinned)"),
                  _term("offload_temp_grad_host", largest * prec.param, "host", "exact", "persistent",
                        src + "__init__ (temp_grad_buffer_for_cpu_offload, pinned)"),
                  _term("offload_temp_grad_gpu", largest * prec.param, "gpu", "exact", "persistent",
                        src + "__init__ (temp_grad_buffer_for_gpu_offload)"),
                  # One parameter at a time, so the largest one sets it; `upper` because it may fall where
                  # the activations are not at their peak.
                  _term("offload_grad_norm_fp64", largest * _NORM_BYTES, "gpu", "upper", "backward",
                        src + "set_norm_for_param_grad_in_gpu / copy_grads_in_partition (each gradient "
                        "cast to fp64, zero/utils.py:get_norm_dtype, for its norm)")]
        return terms
    if stage == 2 and zero.contiguous_gradients:
        terms.append(_zero12_grads(numels, part, world, rank, prec))
    terms.append(_term("step_fp32_grad_partition", part * prec.master, "gpu", "exact", "step:update",
                       src + "step (flattened gradient partition, cast to the master dtype; the gradients freed)"))
    return terms


def _aio_aligned(numel: int, elem: int, ds: dict) -> int:
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.swap_tensor.constants import AIO_INTRA_OP_PARALLELISM
    from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES

    align = AIO_ALIGNED_BYTES * get_aio_config(ds)[AIO_INTRA_OP_PARALLELISM] // elem
    return numel + (-numel) % align


def _stage3_offload(ds: dict, parts: list[int], prec: Any, zero: Any) -> list[dict]:
    src, terms = "runtime/zero/stage3.py:DeepSpeedZeroOptimizer_Stage3.", []
    opt_dev, param_dev = offload_device(zero.offload_optimizer), offload_device(zero.offload_param)
    if opt_dev == "cpu":
        terms.append(_term("offload_fp32_grad_partition", sum(parts) * prec.master, "host", "exact", "persistent",
                           src + "initialize_optimizer_states (subgroup_gradient_buffer, pinned)"))
    if param_dev != "none":
        terms.append(_term("offload_param_flat", sum(parts) * prec.param, "host", "exact", "persistent",
                           src + "_create_param_groups_fp16_flat_cpu_memory (pinned)", "params_bytes"))
    if param_dev == "nvme":
        block = zero.offload_param
        terms.append(_term("nvme_param_swap_buffers", block.buffer_count * _aio_aligned(
            block.buffer_size, prec.param, ds) * prec.param, "host", "exact", "persistent",
            "runtime/swap_tensor/partitioned_param_swapper.py:AsyncPartitionedParameterSwapper.__init__"))
    if opt_dev == "nvme":
        largest = max(stage3_sub_groups(parts, zero.sub_group_size))
        terms.append(_term("nvme_optimizer_swap_buffers", zero.offload_optimizer.buffer_count * _aio_aligned(
            largest, prec.master, ds) * prec.master, "host", "upper", "persistent",
            "runtime/swap_tensor/optimizer_utils.py:OptimizerSwapper.__init__ (SwapBufferManager)"))
    return terms


def _stage3(ds: dict, numels: list[int], train: list[int], world: int, prec: Any, zero: Any) -> list[dict]:
    src = "runtime/zero/stage3.py:DeepSpeedZeroOptimizer_Stage3."
    parts = [stage3_partition_numel(n, world) for n in train]  # the optimizer's partitions
    persist = stage3_persistent(numels, zero)
    # every module parameter (frozen ones too) is all-gathered for forward and backward, at padded size
    gathered = sum(stage3_partition_numel(n, world) * world for n, keep in zip(numels, persist, strict=True)
                   if not keep)
    coord = "runtime/zero/partitioned_param_coordinator.py:PartitionedParameterCoordinator.fetch_sub_module"
    terms = [_term("stage3_live_params", min(zero.max_live_parameters, gathered) * prec.param, "gpu", "upper",
                   "forward+backward", coord + " (cap on gathered parameters; the running module is fetched "
                   "even past it)"),
             _term("stage3_prefetch_bucket", min(zero.prefetch_bucket_size, gathered) * prec.param, "gpu", "upper",
                   "forward+backward", coord + " (prefetch, inside the live-parameter cap)", "stage3_live_params")]
    if zero.contiguous_gradients:
        terms.append(_term("ipg_bucket", zero.reduce_bucket_size * _comm_elem(ds, prec.param), "gpu", "exact",
                           "persistent", src + "_setup_for_real_optimizer (one buffer, overlap_comm or not)"))
    if offload_device(zero.offload_optimizer) == "none":
        largest = max(stage3_sub_groups(parts, zero.sub_group_size))
        cast = prec.master if prec.master != prec.grad_accum else 0
        terms.append(_term("step_fp32_grad_sub_group", largest * (prec.grad_accum + cast), "gpu", "upper", "step:flatten",
                           src + "_prepare_fp32_grad_for_sub_group (flatten, then cast to the master dtype)"))
    return terms + _stage3_offload(ds, parts, prec, zero)


def buffer_terms(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                 rank: int | None = None, use_deepspeed: bool = True,
                 trainable_numels: list[int] | None = None) -> list[dict]:
    """Every DeepSpeed buffer of this configuration, named, with its source. `rank` None: the largest
    over ranks where ranks differ. Plain accelerate has none of DeepSpeed's (torch DDP's are its own).
    `param_numels`: every module parameter, in order; `trainable_numels`: the optimizer's (None: all)."""
    if not use_deepspeed:
        return []
    prec, zero = precision_of(ds_config), zero_config(ds_config)
    if precision is not None and precision != prec.name:
        raise ValueError(f"precision {precision!r} disagrees with the DeepSpeed dict's {prec.name!r}")
    numels, stage = [int(n) for n in param_numels], int(zero.stage)
    train = trainable_or_all(numels, trainable_numels)
    if stage == 0:
        return _stage0(ds_config, train, prec)
    if stage in (1, 2):
        return _zero12(ds_config, train, world_size, rank, prec, zero)
    return _stage3(ds_config, numels, train, world_size, prec, zero)


def gpu_buffer_bytes(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                     rank: int | None = None, use_deepspeed: bool = True,
                     trainable_numels: list[int] | None = None) -> dict:
    """{name: bytes} of the GPU buffers a planner adds to the model states (overlapping terms left out;
    the stage-2 contiguous-gradients buffer counts only what it holds beyond the gradient partition)."""
    terms = buffer_terms(ds_config, param_numels, world_size, precision, rank, use_deepspeed, trainable_numels)
    out = {t["name"]: t["bytes"] for t in terms if t["where"] == "gpu" and not t["overlaps"]}
    for t in terms:
        if t["name"] == "contiguous_gradients":
            part = zero12_flat(trainable_or_all(param_numels, trainable_numels), world_size,
                               zero_config(ds_config).parameter_alignment, precision_of(ds_config).param) // world_size
            out[t["name"]] = max(0, t["bytes"] - part * precision_of(ds_config).param)
    return out


def host_buffer_bytes(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                      rank: int | None = None, use_deepspeed: bool = True,
                      trainable_numels: list[int] | None = None) -> dict:
    """{name: bytes} of DeepSpeed's pinned host buffers beyond the model states (offload staging, swap)."""
    terms = buffer_terms(ds_config, param_numels, world_size, precision, rank, use_deepspeed, trainable_numels)
    out = {t["name"]: t["bytes"] for t in terms if t["where"] == "host" and not t["overlaps"]}
    # ZeRO-2 offload holds the gradient partition in fp32, wider than the parameters' dtype: the excess counts
    wider = [t for t in terms if t["where"] == "host" and t["overlaps"] == "grads_bytes"]
    if wider:
        grads = model_state_bytes(param_numels, ds_config, world_size, rank or 0, use_deepspeed,
                                  trainable_numels)["grads_bytes"]
        out.update({t["name"] + "_beyond_grads": t["bytes"] - grads for t in wider if t["bytes"] > grads})
    return out

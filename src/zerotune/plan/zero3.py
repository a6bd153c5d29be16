"""ZeRO-3's rules (DeepSpeed 0.19.8's stage3.py, partition_parameters.py, parameter_offload.py), each term from the
parameter sizes alone, as a sum: what a CPU plan and the host figure use. On a card the engine's build and the
step are replayed through the caching allocator instead (zero3_replay.py)."""


from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from zerotune.config.schema import MIB, Config
from zerotune.plan import zero3_replay
from zerotune.plan.gpus import GPU
from zerotune.plan.host_memory import (
    PINNED_CACHE,
    PINNED_ROUNDING,
    pinned_block_bytes,
    rounding_bytes,
    torch_pins,
)
from zerotune.plan.resolve import ResolvedRun
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
    states_record,
)
from zerotune.plan.zero3_runtime import (
    NORM_CHUNK,
    stage3_partition_numel,
    stage3_persistent,
    stage3_sub_groups,
    sub_groups,
)
from zerotune.rundir.plan import Phase, Plan, Term, mib_of

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

__all__ = ["buffers", "loading", "stage3_partition_numel", "stage3_persistent", "stage3_sub_groups", "states",
           "step_transients"]

_SRC = "runtime/zero/stage3.py:DeepSpeedZeroOptimizer_Stage3."



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
    part, subs = sum(parts), sub_groups(parts, zero.sub_group_size, groups)
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
    largest = max(sub_groups(parts, zero.sub_group_size, groups))
    persist = stage3_persistent(numels, zero)
    # every module parameter (frozen ones too) is all-gathered for forward and backward, at padded size
    gathered = sum(stage3_partition_numel(n, world) * world for n, keep in zip(numels, persist, strict=True)
                   if not keep)
    coord = "runtime/zero/partitioned_param_coordinator.py:PartitionedParameterCoordinator.fetch_sub_module"
    if world == 1 and param_dev == "none":
        # partition_parameters.py NoGatherHandle line 74: on one rank a partition on the device is the whole
        # parameter, and .to(device) of it is the tensor itself: gathering allocates nothing
        gathered, live, how = 0, 0, "exact"
        said = " (one rank, partitions on the device: a gathered parameter is its partition, no copy)"
    else:  # no bound: __params_to_release keeps parameters reused within stage3_max_reuse_distance past the cap
        live, how = min(zero.max_live_parameters, gathered), "estimate"
        said = (" (stage3_max_live_parameters limits prefetching only; what reuse distance and checkpointing "
                "hold on to is the replay's, step_terms)")
    comm = comm_elem(ds, prec.param)
    # a bucket that holds every trained gradient is flushed once, by independent_gradient_partition_epilogue
    # (stage3.py line 1407) after backward: its transients then come with no activation held
    flush = "reduce" if zero.reduce_bucket_size >= sum(train) else "backward"
    terms = [buffer_term("stage3_live_params", live * prec.param, "gpu", how, "forward+backward", coord + said),
             buffer_term("stage3_prefetch_bucket", min(zero.prefetch_bucket_size, gathered) * prec.param, "gpu",
                         how, "forward+backward", coord + " (prefetch, inside the live-parameter cap)",
                         "stage3_live_params"),
             # each flush of the bucket concatenates its gradients (reduce_scatter_coalesced) while backward runs
             buffer_term("reduce_scatter_buffer", min(zero.reduce_bucket_size, sum(
                 stage3_partition_numel(n, world) * world for n in train)) * comm, "gpu", "upper", flush,
                 "runtime/comm/coalesced_collectives.py:reduce_scatter_coalesced line 122 (torch.cat of the "
                 "bucket's gradients, called by " + src + "__avg_scatter_grads)")]
    if zero.contiguous_gradients:
        terms.append(buffer_term("ipg_bucket", zero.reduce_bucket_size * comm, "gpu", "exact",
                                 "persistent", src + "_setup_for_real_optimizer (one buffer, overlap_comm or not)"))
    if opt_dev == "none":
        cast = prec.master if prec.master != prec.grad_accum else 0
        terms += [buffer_term("step_flat_grad_sub_group", largest * (prec.grad_accum + cast), "gpu", "exact",
                              "step:flatten", src + "_prepare_fp32_grad_for_sub_group line 2686 (the largest "
                              "sub-group's gradients flattened, then cast to the master dtype)"),
                  buffer_term("step_fp32_grad_sub_group", largest * (prec.master if cast else prec.grad_accum), "gpu",
                              "exact", "step:update", src + "_prepare_fp32_grad_for_sub_group line 2686 (the largest "
                              "sub-group's gradient while the optimizer steps it; _release_sub_group frees it)")]
    else:  # partition_grads, one parameter at a time: its partition back on the device, then its norm in fp64
        part = max(parts)
        terms += [buffer_term("offload_grad_partition_gpu", part * prec.grad_accum, "gpu", "exact", flush,
                              src + "partition_grads line 2028 (grad_buffer.to(device), the largest partition)"),
                  buffer_term("offload_grad_norm_fp64", min(part, NORM_CHUNK) * 8, "gpu", "exact", flush,
                              src + "_constant_buffered_norm2 line 1964 (.to(fp64), 250M elements at a time; "
                              "the .to(fp32) copy of line 1457 comes after it, smaller)")]
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
    return terms + _pinned_host_terms(numels, train, parts, persist, world, prec, zero, groups)


def _pinned_host_terms(numels: list[int], train: list[int], parts: list[int], persist: list[bool], world: int,
                       prec: Precision, zero: DeepSpeedZeroConfig, groups: list[int] | None) -> list[Term]:
    """What torch's pinned allocator holds beyond the pinned host tensors of the model states and buffers() (a
    power-of-two block each; a freed one stays cached). `parts`: the optimizer's partitions, in elements."""
    src, opt_dev, param_dev = _SRC, offload_device(zero.offload_optimizer), offload_device(zero.offload_param)
    terms: list[Term] = []
    if opt_dev != "none" and zero.offload_optimizer.pin_memory and torch_pins():
        terms.append(buffer_term("offload_grad_partitions_flat" + PINNED_ROUNDING,
                                 rounding_bytes([sum(parts) * prec.grad_accum]), "host", "exact", "persistent",
                                 src + "__init__ lines 789-795 (grad_partitions_flat_buffer, the `grads` term, "
                                 "pinned: a power-of-two block, pinned.py)"))
        if opt_dev == "cpu":
            subs = sub_groups(parts, zero.sub_group_size, groups)
            terms.append(buffer_term("offload_fp32_grad_partition" + PINNED_ROUNDING,
                                     rounding_bytes(n * prec.master for n in subs), "host", "exact", "persistent",
                                     src + "initialize_optimizer_states lines 1338-1340 (each sub-group's "
                                     "subgroup_gradient_buffer pinned)"))
    if param_dev == "cpu" and zero.offload_param.pin_memory and torch_pins():
        terms.append(buffer_term("offload_param_flat" + PINNED_ROUNDING, rounding_bytes(
            sum(g) * prec.param for g in split_groups(parts, groups)), "host", "exact", "persistent",
            src + "_create_param_groups_fp16_flat_cpu_memory line 906 (each parameter group's flat buffer, the "
            "`params` term, pinned)"))
        # partition_parameters.py _partition_param lines 1842-1843: zero.Init pins each parameter's partition
        # on its own. _move_to_flat_buffer (stage3.py line 883) points the trained ones into the flat buffer:
        # their blocks go back to the allocator's cache, whole; the frozen ones keep theirs.
        trained, held = Counter(train), 0
        for n, keep in zip(numels, persist, strict=True):
            if trained[n]:
                trained[n] -= 1
                block = 0 if keep else pinned_block_bytes(stage3_partition_numel(n, world) * prec.param)
            else:
                block = 0 if keep else rounding_bytes([stage3_partition_numel(n, world) * prec.param])
            held += block
        terms.append(buffer_term("zero_init_param_partitions" + PINNED_CACHE, held, "host", "exact", "persistent",
                                 "runtime/zero/partition_parameters.py:Init._partition_param lines 1842-1843 (each "
                                 "parameter's partition pinned alone; the trained ones' blocks, freed by stage3.py "
                                 "_move_to_flat_buffer line 883, stay in torch's pinned cache)"))
    return terms


def step_transients(shape: StepShape) -> list[Term]:
    """None beyond buffers(): the sub-group's gradient during the update is its step_fp32_grad_sub_group term,
    sized by the largest sub-group (StepShape has the mean)."""
    return []


def loading(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, plan: Plan, base: list[Term]) -> Phase:
    """ZeRO-3's engine build, replayed through the caching allocator (zero3_replay.loading_memory): zero.Init's
    fp32 build and cast, keeping this rank's partitions on the device unless offloaded; defragment's flat buffer;
    the fp32 masters, the reduce bucket and the gradient partitions. The trainer then empties the cache
    (Trainer._prepare): a segment still holding a live block stays reserved, whole."""
    found = zero3_replay.loading_memory(cfg, resolved)
    at = found["at_reserved_peak"]
    terms = [*base, *zero3_replay.terms_at(at, "", "replayed engine build")]
    return Phase("loading", mib_of(terms), tuple(terms), end_live_mib=mib_of(base) + found["end_reserved"] / MIB,
                 source="partition_parameters.py zero.Init; stage3.py DeepSpeedZeroOptimizer_Stage3.__init__, "
                      "replayed through the caching allocator (runtime/zero/utils.py defragment empties the cache "
                      "at line 234, before the flat buffer; train/trainer.py Trainer._prepare once the engine is "
                      "built: only segments still in use carry over)")

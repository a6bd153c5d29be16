"""ZeRO-3's rules (DeepSpeed 0.19.8's runtime/zero/stage3.py, partition_parameters.py, parameter_offload.py):
each module parameter is padded to a multiple of the world size and split evenly.

Two ways to the card's memory. The rules (states, buffers, step_transients) give each term from the parameter
sizes alone, as a sum. The replay (step_memory, step_terms, and loading) runs DeepSpeed's own ZeRO-3 hooks and
parameter coordinator over a fake-tensor copy of the model, the engine's build and three training steps, and
passes every allocation through a simulator of torch's caching allocator (allocator.CachingAllocator), so
what ZeRO-3 gathers, keeps and frees in which order, and the reserve its frees leave, are counted rather than
bounded. On the H100 grid (experiments/results/gpu/h100-2026-11-26, SDXL 512 px, bf16, AdamW, one rank),
replaying the trainer those runs had (no empty_cache after the engine's build: _run(emptied=False)), the
allocated peaks of steps 1 and 2 are torch's within 2 MiB (CPU offload, step 2) to 34 MiB, the reserved peaks
within 4 MiB without offload, but 60 MiB (batch 1) and 116 MiB (batch 4) above torch's with CPU offload: the
activations are traced through torch's CPU kernels (attention's saved tensors, no cuDNN workspaces), so the
blocks that fill the segments freed by the gathered parameters are not the card's exactly. Today's trainer
empties the cache once the engine is built (training/trainer.py, commit d6e1446), which the replay follows:
without offload it then reserves 60,886 MiB in step 2 instead of 62,090 (unmeasured yet). A replay of SDXL
takes about 40 s on two cores, once per setting (cached under <cache>/plan/zero3-<key>.json)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from zerotune.plan import allocator
from zerotune.plan.gpus import GPU
from zerotune.plan.pinned import PINNED_CACHE, PINNED_ROUNDING, pinned_block_bytes, rounding_bytes, torch_pins
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
    term,
)
from zerotune.resolved import ResolvedRun
from zerotune.rundir.plan import Term
from zerotune.schema import Config
from zerotune.units import MIB

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
    terms = [buffer_term("stage3_live_params", live * prec.param, "gpu", how, "forward+backward", coord + said),
             buffer_term("stage3_prefetch_bucket", min(zero.prefetch_bucket_size, gathered) * prec.param, "gpu",
                         how, "forward+backward", coord + " (prefetch, inside the live-parameter cap)",
                         "stage3_live_params"),
             # each flush of the bucket concatenates its gradients (reduce_scatter_coalesced) while backward runs
             buffer_term("reduce_scatter_buffer", min(zero.reduce_bucket_size, sum(
                 stage3_partition_numel(n, world) * world for n in train)) * comm, "gpu", "upper", "backward",
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
        terms += [buffer_term("offload_grad_partition_gpu", part * prec.grad_accum, "gpu", "exact", "backward",
                              src + "partition_grads line 2028 (grad_buffer.to(device), the largest partition)"),
                  buffer_term("offload_grad_norm_fp64", min(part, NORM_CHUNK) * 8, "gpu", "exact", "backward",
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
    """What torch's pinned allocator holds beyond the host tensors of the model states and buffers() (pinned.py):
    each pinned tensor takes a power-of-two block, and a freed one stays in the allocator's cache. Per pinned
    tensor: each sub-group's fp32 gradient, the flat gradient partitions, each parameter group's flat parameter
    buffer, and zero.Init's per-parameter partitions (`parts`: the optimizer's, in elements)."""
    src, opt_dev, param_dev = _SRC, offload_device(zero.offload_optimizer), offload_device(zero.offload_param)
    terms: list[Term] = []
    if opt_dev != "none" and zero.offload_optimizer.pin_memory and torch_pins():
        terms.append(buffer_term("offload_grad_partitions_flat" + PINNED_ROUNDING,
                                 rounding_bytes([sum(parts) * prec.grad_accum]), "host", "exact", "persistent",
                                 src + "__init__ lines 789-795 (grad_partitions_flat_buffer, the `grads` term, "
                                 "pinned: a power-of-two block, pinned.py)"))
        if opt_dev == "cpu":
            subs = _sub_groups(parts, zero.sub_group_size, groups)
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


def step_transients(shape: StepShape) -> list[dict]:
    """None beyond buffers(): the sub-group's gradient during the update is its step_fp32_grad_sub_group term,
    sized by the largest sub-group (StepShape has the mean)."""
    return []


def loading(cfg: Config, checked: ResolvedRun, gpu: GPU | None, plan: dict, base: list[dict]) -> dict:
    """ZeRO-3's engine build, replayed through the caching allocator (_load, allocator.CachingAllocator): zero.Init
    builds each module's tensors in fp32 and casts them (partition_parameters.py zero_wrapper_for_fp_tensor_
    constructor, line 266), keeping this rank's partition on the device unless the parameters are offloaded
    (_partition_param, line 1836); without offloaded parameters the optimizer moves the partitions to the host,
    empties the cache and copies them back as one flat buffer (runtime/zero/utils.py defragment, lines 234-237);
    without optimizer offload each sub-group's fp32 master is `.to(fp32).clone()` (stage3.py line 1170) and
    initialize_optimizer_states allocates then frees the largest sub-group's gradient buffer (line 1306); then
    the reduce bucket (line 782) and the gradient partitions (line 791). The trainer then empties the cache
    (training/trainer.py Trainer._prepare): a segment still holding a live block stays reserved, whole."""
    found = loading_memory(cfg, checked)
    at = found["at_reserved_peak"]
    terms = [*base, *_terms(at, "", "replayed engine build")]
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms,
            "end_live_mib": sum(t["mib"] for t in base) + found["end_reserved"] / MIB,
            "source": "partition_parameters.py zero.Init; stage3.py DeepSpeedZeroOptimizer_Stage3.__init__, "
                      "replayed through the caching allocator (runtime/zero/utils.py defragment empties the cache "
                      "at line 234, before the flat buffer; training/trainer.py Trainer._prepare once the engine is "
                      "built: only segments still in use carry over)"}


_LOADINGS: dict[str, dict] = {}


def loading_memory(cfg: Config, checked: ResolvedRun) -> dict:
    """The engine build's peaks on the device, replayed (allocations only: the model is built on the meta device),
    as _Pool.record gives them: {"allocated", "reserved", "at_allocated_peak", "at_reserved_peak"}, and
    "end_reserved": what stays reserved once the trainer has emptied the cache after the build."""
    from zerotune.plan import activations
    from zerotune.plan.rules import precision_of, zero_config
    from zerotune.schema import launch_world_size

    key = _replay_key(cfg, checked, "loading")
    if key not in _LOADINGS:
        ds, zero, prec = checked.ds_config, zero_config(checked.ds_config), precision_of(checked.ds_config)
        world = launch_world_size(cfg.launch)
        model = activations._meta_trained(cfg.model, cfg.precision.name, bool(cfg.train.gradient_checkpointing),
                                          str(cfg.model.attention), cfg.adapter)
        trained = [p for p in model.parameters() if p.requires_grad]
        subs = _sub_groups([stage3_partition_numel(p.numel(), world) for p in trained], zero.sub_group_size,
                           checked.group_sizes())
        pool = _Pool()
        _load(model, pool, world, offload_device(zero.offload_param) != "none",
              offload_device(zero.offload_optimizer) != "none", prec, comm_elem(ds, prec.param), zero, subs, trained)
        _LOADINGS[key] = pool.record()
        pool.sim.empty_cache()  # training/trainer.py Trainer._prepare, once the engine is built
        _LOADINGS[key]["end_reserved"] = pool.sim.reserved
    return _LOADINGS[key]


# ------------------------------------------------------------------------------------------------------------
# The training step on a card, replayed allocation by allocation.
#
# DeepSpeed's own ZeRO-3 machinery runs on a fake-tensor copy of the model (activations.py builds it as training
# does): parameter_offload.py's module hooks (DeepSpeedZeRoOffload._register_deepspeed_module) and
# partitioned_param_coordinator.py's PartitionedParameterCoordinator (trace recording in step 1, then prefetch
# and reuse-distance release), torch's gradient checkpointing (its recomputed saved tensors keep a gathered
# parameter's storage alive after the coordinator releases it). What the coordinator calls on a parameter
# (all_gather_coalesced, partition) and the stage-3 optimizer's gradient hooks, bucket flushes and step are
# replicated below with their lines. Every storage an op returns, and every buffer DeepSpeed allocates, goes
# through allocator.CachingAllocator; nvidia-smi's figure is its reserved peak plus the CUDA context.

REPLAY_STEPS = 3        # the kit's runs: step 1 records the module trace, step 2 prefetches, step 3 repeats step 2
REPLAY_FORMAT = 2       # bump when what a replay measures changes: older cache entries then miss
NORM_CHUNK = 250_000_000  # stage3.py _constant_buffered_norm2's buffer_size
_REPLAYS: dict[str, dict | None] = {}

# Each allocation carries a tag: the plan term it adds to, whether it lasts the whole step, the line allocating it.
_TAGS: dict[str, tuple[str, bool, str]] = {
    "params": ("params", True, "runtime/zero/utils.py:defragment line 237 (cpu_buffer.to(device): the flat "
                               "partition buffer, stage3.py line 972)"),
    "frozen_params": ("params", True, "partition_parameters.py:_partition_param line 1836 (a frozen parameter's "
                                      "partition, its own block: stage 3 defragments the optimizer's only)"),
    "params_persistent": ("params_persistent", True, "stage3.py:_post_step line 2841 (the persistent parameters "
                                                     "gathered, partition_parameters.py NoGatherHandle line 74)"),
    "master_weights": ("master_weights", True, "stage3.py:_create_fp32_partitions lines 1170-1172 (.to(fp32) then "
                                               ".clone(), one sub-group at a time)"),
    "grads": ("grads", True, "stage3.py:_setup_for_real_optimizer line 791 (grad_partitions_flat_buffer)"),
    "ipg_bucket": ("deepspeed:ipg_bucket", True, "stage3.py:_setup_for_real_optimizer line 782"),
    "optimizer_states": ("optimizer_states", True, "the optimizer's state, created at the first step one "
                                                   "sub-group at a time (stage3.py:_optimizer_step line 1235)"),
    "cublas_workspace": ("cublas_workspace", True, "torch CublasHandlePool.cpp: allocated at the first matmul"),
    "backup_optimizer": ("deepspeed:backup_optimizer", True, "stage3.py line 314 (a 1-element GPU parameter)"),
    "loading": ("loading_transient", False, "partition_parameters.py zero_wrapper_for_fp_tensor_constructor "
                                            "line 266 (each tensor built fp32, then cast) and the partition "
                                            "copies; stage3.py line 1170 (.to(fp32)), line 1306 "
                                            "(gradient_buffer), line 1504 (param.all_gather() per parameter)"),
    "gathered_params": ("gathered_params", False,
                        "partition_parameters.py NoGatherHandle line 74 (ds_tensor.to(device); one rank) or "
                        "_all_gather_sequential/_all_gather_coalesced buffers: fetched and prefetched by "
                        "partitioned_param_coordinator.py fetch_sub_module (line 310), released by "
                        "release_sub_module (line 494) past __params_to_release's reuse distance (line 634), "
                        "held on by checkpointing's recomputed saved tensors"),
    "activations": ("activations", False, "the fake-tensor forward and backward (inputs, saved and recomputed "
                                          "activations, their gradients)"),
    "param_grads": ("param_grads", False, "autograd's parameter gradients, until stage3.py line 1637 copies each "
                                          "into the bucket (line 1640)"),
    "reduce_buffer": ("deepspeed:reduce_scatter_buffer", False,
                      "runtime/comm/coalesced_collectives.py:reduce_scatter_coalesced line 122 (torch.cat of the "
                      "bucket's gradients, each flush)"),
    "grad_copies": ("deepspeed:grad_partition_copies", False,
                    "stage3.py:partition_grads line 2028 (grad_buffer.to(device)), _constant_buffered_norm2 line "
                    "1964 (.to(fp64), 250M elements at a time), line 1457 (.to(fp32)): one parameter at a time"),
    "grad_norms": ("deepspeed:grad_norms", False, "stage3.py line 1447 (one fp64 scalar per parameter on the "
                                                  "device until the step)"),
    "step_norm": ("step_grad_norm", False, "stage3.py:get_grad_norm_direct line 2457 (.to(fp64) of one "
                                           "gradient partition at a time)"),
    "step_flatten": ("step_flat_grad_sub_group", False, "stage3.py:_prepare_fp32_grad_for_sub_group line 2686 "
                                                        "(flatten of the sub-group's gradients)"),
    "step_fp32_grad": ("step_fp32_grad_sub_group", False, "stage3.py line 2686 (.to(fp32): the sub-group's "
                                                          "gradient, freed by _release_sub_group)"),
    "optimizer_temporaries": ("optimizer_temporaries", False, "plan/step_peak.py's rule for the optimizer, "
                                                              "applied to one sub-group per optimizer.step()"),
}
_MOMENTS = {"carried": "persistent", "loading": "persistent", "forward": "forward+backward",
            "backward": "forward+backward", "step": "step:update"}


class _Pool:
    """allocator.CachingAllocator with a tag per live block: what each is, and the tags' totals at the peaks."""

    def __init__(self) -> None:
        self.sim = allocator.CachingAllocator()
        self.tags: dict[int, tuple[str, int]] = {}
        self.totals: dict[str, int] = {}
        self.tag, self.phase = "activations", "loading"
        self.reset()

    def reset(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): the peaks restart from what is held now (`carried`)."""
        self.sim.reset_peaks()
        self.at_allocated = self.at_reserved = ("carried", dict(self.totals), self.sim.reserved)
        self._snapshot = (self.sim.reserved, self.sim.allocated)

    def malloc(self, nbytes: int, tag: str | None = None) -> int:
        handle = self.sim.malloc(int(nbytes))
        if handle:
            name, size = tag or self.tag, self.sim._live[handle].size
            self.tags[handle] = (name, size)
            self.totals[name] = self.totals.get(name, 0) + size
            if self.sim.allocated >= self.sim.peak_allocated:
                self.at_allocated = (self.phase, dict(self.totals), self.sim.reserved)
            # nvidia-smi's peak: the most allocated while the reserve is at its largest (it never shrinks here)
            if (self.sim.reserved, self.sim.allocated) >= self._snapshot:
                self.at_reserved = (self.phase, dict(self.totals), self.sim.reserved)
                self._snapshot = (self.sim.reserved, self.sim.allocated)
        return handle

    def free(self, handle: int) -> None:
        if handle in self.tags:
            name, size = self.tags.pop(handle)
            self.totals[name] -= size
            self.sim.free(handle)

    def retag(self, handle: int | None, tag: str) -> None:
        if handle in self.tags:
            name, size = self.tags[handle]
            self.totals[name] -= size
            self.totals[tag] = self.totals.get(tag, 0) + size
            self.tags[handle] = (tag, size)

    def record(self) -> dict:
        """This step's (or loading's) peaks and what made them up, in bytes."""
        def parts(at: tuple[str, dict, int]) -> dict:
            phase, totals, reserved = at
            kept = {k: v for k, v in totals.items() if v}
            return {"phase": phase, "tags": kept, "cached": reserved - sum(kept.values())}
        return {"allocated": self.sim.peak_allocated, "reserved": self.sim.peak_reserved,
                "at_allocated_peak": parts(self.at_allocated), "at_reserved_peak": parts(self.at_reserved)}


def step_memory(cfg: Config, checked: ResolvedRun, gpu: GPU | None, emptied: bool = True) -> dict | None:
    """The replay's figures for this run on this card, from this process's or the disk cache if it holds them:
    {"loading": peaks, "steps": [peaks per step], "seconds", "key"}, each peaks record {"allocated",
    "reserved" (bytes), "at_allocated_peak"/"at_reserved_peak": {"phase", "tags" {tag: bytes}, "cached"}}.
    None where the replay cannot run (its reason logged): the rules above then stand alone. `emptied` False:
    the trainer as it was before it emptied the cache after the engine's build (rows recorded before d6e1446)."""
    from zerotune import files
    from zerotune.plan import activations

    family = gpu.family if gpu else "unknown"
    key = _replay_key(cfg, checked, family) + ("" if emptied else "-kept")
    if key not in _REPLAYS:
        file = activations.cache_dir() / f"zero3-{key}.json"
        found = files.read_json(file)
        if isinstance(found, dict) and found.get("key") == key:
            _REPLAYS[key] = found
        else:
            try:
                _REPLAYS[key] = _replay(cfg, checked, family, key, emptied)
            except Exception as err:  # noqa: BLE001  # a model or setting the replay cannot run: the rules stand
                import logging

                logging.getLogger(__name__).warning("ZeRO-3 step replay unavailable (%s: %s); planning from the "
                                                    "rules alone", type(err).__name__, err)
                _REPLAYS[key] = None
            if _REPLAYS[key] is not None:
                files.write_cached_json(file, _REPLAYS[key])
    return _REPLAYS[key]


def step_terms(cfg: Config, checked: ResolvedRun, gpu: GPU | None, emptied: bool = True) -> list[dict] | None:
    """The training step's GPU terms at its nvidia-smi peak (the CUDA context aside), from the replay: the
    step whose reserved figure is the largest, what was allocated at that moment tag by tag, and the cached
    free blocks (`allocator_reserve`). They add up to the replayed reserved peak, what loading left reserved
    included. Model states and persistent buffers are `persistent`; the rest carry the moment of the peak.
    None where the replay cannot run. `emptied`: as step_memory's. For predict.predict at ZeRO-3 on a card: its
    gpu_terms after cuda_context, in place of the rules' (states, buffers and transients as a sum)."""
    found = step_memory(cfg, checked, gpu, emptied)
    if found is None:
        return None
    step = max(found["steps"], key=lambda s: s["reserved"])
    return _terms(step["at_reserved_peak"], found["optimizer_source"],
                  f"replayed step {found['steps'].index(step) + 1} of {len(found['steps'])}")


def _terms(at: dict, optimizer_source: str, said: str) -> list[dict]:
    moment = _MOMENTS[at["phase"]]
    merged: dict[str, list] = {}
    for tag, nbytes in at["tags"].items():
        name, lasting, source = _TAGS[tag]
        if tag == "optimizer_states":
            source = f"{optimizer_source} ({source})"
        entry = merged.setdefault(name, [0, lasting, []])
        entry[0] += nbytes
        entry[2].append(source)
    terms = [term(name, nbytes, f"{said}: " + "; ".join(dict.fromkeys(sources)),
                  None if lasting else moment) for name, (nbytes, lasting, sources) in merged.items()]
    terms.append(term("allocator_reserve", at["cached"],
                      f"{said}: cached free blocks (torch's caching allocator, allocator.CachingAllocator: freed "
                      "blocks stay reserved, a request too large for every cached block gets a new segment)",
                      moment))
    return terms


def _replay_key(cfg: Config, checked: ResolvedRun, family: str) -> str:
    import hashlib
    import json

    import deepspeed

    from zerotune.plan import activations
    from zerotune.plan.context import CUBLAS_WORKSPACE
    from zerotune.schema import launch_world_size

    ds = checked.ds_config
    trace = activations.trace_key(cfg.model, checked.input_shape, int(ds["train_micro_batch_size_per_gpu"]),
                                  cfg.precision.name, bool(cfg.train.gradient_checkpointing),
                                  str(cfg.model.attention), cfg.adapter)
    what = {"zero": ds["zero_optimization"], "optimizer": ds.get("optimizer"), "client": checked.client_optimizer,
            "ga": ds["gradient_accumulation_steps"], "world": launch_world_size(cfg.launch),
            "groups": checked.group_sizes(), "precision": {k: ds.get(k) for k in ("bf16", "fp16", "data_types",
                                                                               "communication_data_type")},
            "clip": ds.get("gradient_clipping"), "cublas": CUBLAS_WORKSPACE.get(family, 0),
            "deepspeed": deepspeed.__version__, "steps": REPLAY_STEPS}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{trace}-{digest}-r{REPLAY_FORMAT}"


class _Accelerator:
    """What the coordinator asks DeepSpeed's accelerator, answered as one synchronous stream does (the replay has
    one stream: overlap_comm is off, so the all-gather stream is the default one, parameter_offload.py line 195)."""

    @staticmethod
    def stream(_stream):
        import contextlib

        return contextlib.nullcontext()

    Event = None

    @staticmethod
    def handles_memory_backpressure() -> bool:
        return True

    @staticmethod
    def resolves_data_dependency() -> bool:
        return True

    @staticmethod
    def is_synchronized_device() -> bool:
        return True

    @staticmethod
    def current_stream(device_index=None):
        return None

    @staticmethod
    def current_device_name() -> str:
        return "cpu"


def _replay(cfg: Config, checked: ResolvedRun, family: str, key: str, emptied: bool = True) -> dict:
    import contextlib
    import time
    from unittest import mock

    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerotune.plan import activations

    start = time.perf_counter()
    model = activations._meta_trained(cfg.model, cfg.precision.name, bool(cfg.train.gradient_checkpointing),
                                      str(cfg.model.attention), cfg.adapter)
    patches = [mock.patch.object(coordinator_module, "print_rank_0", lambda *a, **k: None),
               mock.patch.object(coordinator_module, "assert_ints_same_as_other_ranks", lambda *a, **k: None),
               mock.patch.object(coordinator_module, "get_accelerator", lambda: _Accelerator),
               mock.patch.object(parameter_offload, "print_rank_0", lambda *a, **k: None)]
    stack = list(parameter_offload.FWD_MODULE_STACK)
    try:
        with contextlib.ExitStack() as context:
            for patch in patches:
                context.enter_context(patch)
            context.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            model.to_empty(device="cpu")
            result = _run(model, cfg, checked, _Pool(), family, emptied)
    finally:
        parameter_offload.FWD_MODULE_STACK[:] = stack
        # __params_to_release is an lru_cache on the class (under instrument_w_nvtx): it would keep the model alive
        cached = coordinator_module.PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
        getattr(cached, "cache_clear", getattr(getattr(cached, "__wrapped__", None), "cache_clear", lambda: None))()
    return {**result, "seconds": round(time.perf_counter() - start, 1), "key": key}


def _run(model, cfg: Config, checked: ResolvedRun, pool: _Pool, family: str, emptied: bool = True) -> dict:
    """The engine's build, then REPLAY_STEPS training steps, on `model` (fake tensors, under FakeTensorMode).
    `emptied`: the trainer empties the cache between the two (training/trainer.py Trainer._prepare, since commit
    d6e1446); False replays the trainer the H100 grid ran, which did not."""
    import torch
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as status
    from deepspeed.runtime.zero.partition_parameters import _init_external_params

    from zerotune.plan import activations
    from zerotune.plan.context import CUBLAS_WORKSPACE
    from zerotune.plan.rules import precision_of, zero_config
    from zerotune.schema import launch_world_size

    ds, zero, prec = checked.ds_config, zero_config(checked.ds_config), precision_of(checked.ds_config)
    world, ga = launch_world_size(cfg.launch), int(ds["gradient_accumulation_steps"])
    host_params = offload_device(zero.offload_param) != "none"
    host_optimizer = offload_device(zero.offload_optimizer) != "none"
    kind = optimizer_kind(ds, host_optimizer, prec, client=checked.client_optimizer)
    comm, cublas = comm_elem(ds, prec.param), CUBLAS_WORKSPACE.get(family, 0)
    dtype = activations.DTYPES[cfg.precision.name]
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    mode = _storage_mode(pool)
    gather = _Gather(pool, mode, world, host_params, status)
    for i, p in enumerate(params):  # the attributes partition_parameters.py gives a ZeRO parameter
        p.ds_id, p.ds_numel, p.ds_shape = i, p.numel(), tuple(p.shape)
        p.ds_tensor, p.ds_status = p.data.view(-1), status.NOT_AVAILABLE
        p.ds_tensor.final_location = None
        p.ds_persist, p.ds_active_sub_modules = False, set()
        p.nvme_swapper = p.ds_secondary_tensor = None
        p.is_external_param = False
        p.partition_numel = (lambda p=p: stage3_partition_numel(p.ds_numel, world))
        p.ds_summary = (lambda p=p: {"id": p.ds_id, "status": p.ds_status.name})
        p.all_gather_coalesced = gather.coalesced
        p.all_gather = (lambda param_list=None, async_op=False, hierarchy=0, p=p: gather.now(param_list or [p]))
        p.partition = (lambda param_list=None, hierarchy=0, has_been_updated=False, free_data=True, p=p:
                       gather.release(param_list or [p], free_data))
        mode.ignore(p.ds_tensor)
        p.data = torch.empty(0, dtype=p.dtype)
    for m in model.modules():
        _init_external_params(m)
    offload = object.__new__(DeepSpeedZeRoOffload)  # parameter_offload.py DeepSpeedZeRoOffload, its hooks and coordinator
    offload.module, offload.zenflow, offload.forward_hooks, offload.backward_hooks = model, False, [], []
    offload.param_coordinator = coordinator_module.PartitionedParameterCoordinator(
        prefetch_bucket_sz=int(zero.prefetch_bucket_size), max_reuse_distance_in_numel=int(zero.max_reuse_distance),
        max_available_parameters_in_numel=int(zero.max_live_parameters), allgather_stream=None,
        inflight_param_registry=coordinator_module.InflightParamRegistry())
    offload.persistent_parameters = offload.mark_persistent_parameters(int(zero.param_persistence_threshold),
                                                                       int(zero.model_persistence_threshold))
    offload.setup_zero_stage3_hooks()
    # DeepSpeedZeRoOffload.__init__: a parameter read outside its module during forward is gathered then
    # (ZeROOrderedDict.__getitem__) and coordinated with the module that read it (register_external_parameter)
    parameter_offload._inject_parameters(model, parameter_offload.ZeROOrderedDict)
    subs = _sub_groups([stage3_partition_numel(p.ds_numel, world) for p in trained], zero.sub_group_size,
                       checked.group_sizes())
    _load(model, pool, world, host_params, host_optimizer, prec, comm, zero, subs, trained)
    loading = pool.record()
    if emptied:  # Trainer._prepare: torch.cuda.empty_cache() once accelerate.prepare has built the engine
        pool.sim.empty_cache()
    loading["end_reserved"] = pool.sim.reserved
    reducer = _Reducer(pool, mode, world, host_optimizer, prec, comm, int(zero.reduce_bucket_size), dtype,
                       bool(zero.contiguous_gradients))
    for p in trained:
        p.register_post_accumulate_grad_hook(reducer.hook)
    steps, states = [], {}
    with mode, torch.enable_grad():
        pool.phase = "forward"
        if cublas:  # the first matmul's workspace, then cuBLASLt's (plan/context.py)
            pool.malloc(cublas - MIB, "cublas_workspace")
            pool.malloc(MIB, "cublas_workspace")
        for _ in range(REPLAY_STEPS):
            pool.reset()
            for micro in range(ga):
                pool.phase = "forward"
                reducer.micro, reducer.boundary = micro, micro == ga - 1
                inputs = activations._inputs(cfg.model, checked.input_shape,
                                             int(checked.ds_config["train_micro_batch_size_per_gpu"]), dtype)
                _in_forward(model, True)  # engine.py _forward_prologue / _forward_epilogue (lines 2955, 2969)
                loss = activations._loss(model, cfg.model, inputs)
                _in_forward(model, False)
                pool.phase = "backward"
                loss.backward()
                reducer.flush()  # independent_gradient_partition_epilogue (stage3.py line 1407)
                offload.param_coordinator.release_backward_leftovers()  # backward_epilogue (line 3068)
                if micro == ga - 1:
                    pool.phase = "step"
                    _step(offload, pool, reducer, host_optimizer, kind, prec, subs, trained, states, world)
                del inputs, loss
            steps.append(pool.record())
    return {"loading": loading, "steps": steps, "optimizer_source": kind.source}


def _in_forward(model, on: bool) -> None:
    """engine.py _forward_prologue/_forward_epilogue: ZeROOrderedDict gathers a parameter read while on."""
    for m in model.modules():
        m._parameters._in_forward = on


def _load(model, pool: _Pool, world, host_params, host_optimizer, prec: Precision, comm, zero, subs, trained):
    """The engine's build, in order (synthetic: sizes from the fake model)."""
    trained_ids = {id(p) for p in trained}
    partitions = {}
    for m in model.modules():  # zero.Init: each module's tensors built fp32 and cast, then partitioned
        own = list(m.parameters(recurse=False))
        built = []
        for p in own:
            fp32 = pool.malloc(_numel(p) * 4, "loading")
            if prec.param != 4:
                built.append(pool.malloc(_numel(p) * prec.param, "loading"))
                pool.free(fp32)
            else:
                built.append(fp32)
        for p in own:  # _partition_param line 1836: the partition on the GPU unless the parameters are offloaded
            if not host_params:
                tag = "frozen_params" if id(p) not in trained_ids else "loading"
                partitions[id(p)] = pool.malloc(stage3_partition_numel(_numel(p), world) * prec.param, tag)
        for handle in built:
            pool.free(handle)
    if not host_params:  # defragment (runtime/zero/utils.py line 215): to the host, empty_cache, one flat buffer
        for p in trained:
            pool.free(partitions.pop(id(p)))
        pool.sim.empty_cache()
        pool.malloc(sum(subs) * prec.param, "params")
    if host_optimizer:  # stage3.py line 314: a backup GPU parameter for partial offload
        scratch = pool.malloc(4, "loading")
        pool.malloc(prec.param, "backup_optimizer")
        pool.free(scratch)
    else:  # _create_fp32_partitions: a converted copy cloned, unless the partition already is fp32 (line 1163)
        for n in subs:
            if prec.master != prec.param:
                converted = pool.malloc(n * prec.master, "loading")
                pool.malloc(n * prec.master, "master_weights")
                pool.free(converted)
        pool.free(pool.malloc(max(subs) * prec.master, "loading"))  # initialize_optimizer_states gradient_buffer
    if zero.contiguous_gradients:
        pool.malloc(int(zero.reduce_bucket_size) * comm, "ipg_bucket")
    if not host_optimizer:
        pool.malloc(sum(subs) * prec.grad_accum, "grads")
    if host_params or world > 1:  # create_reduce_and_remove_grad_hooks: all_gather then partition, one at a time
        for p in trained:
            pool.free(pool.malloc(_gathered_numel(_numel(p), world) * prec.param, "loading"))


def _numel(p) -> int:
    """A parameter's elements: its ZeRO size once the replay has emptied it, else its own."""
    return getattr(p, "ds_numel", None) or p.numel()


def _gathered_numel(numel: int, world: int) -> int:
    return stage3_partition_numel(numel, world) * world


def _storage_mode(pool: _Pool):
    """A torch dispatch mode: every new storage an op returns is a block of the pool, freed with its storage
    (a weak reference's callback, as torch's MemTracker follows storages)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class Storages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = WeakIdKeyDictionary()
            self.refs: dict[int, weakref.ref] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
            return out

        def track(self, t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            handle = self.seen.get(storage)
            if handle is None:
                handle = self.seen[storage] = pool.malloc(storage.nbytes())
                if handle:
                    self.refs[handle] = weakref.ref(storage, lambda _, h=handle: self.gone(h))
            return handle

        def gone(self, handle: int) -> None:
            self.refs.pop(handle, None)
            pool.free(handle)

        def ignore(self, t: torch.Tensor) -> None:
            """A storage the pool accounts for itself (a partition, the bucket): never a block of its own."""
            self.seen[t.untyped_storage()] = 0

        def handle(self, t: torch.Tensor) -> int | None:
            return self.seen.get(t.untyped_storage())

    return Storages()


class _Gather:
    """What the coordinator calls on parameters: all_gather_coalesced (a handle whose wait() makes them AVAILABLE,
    once, for all of them, as AllGatherCoalescedHandle), all_gather, partition (free_param)."""

    def __init__(self, pool: _Pool, mode, world: int, host_params: bool, status) -> None:
        self.pool, self.mode, self.world, self.host, self.status = pool, mode, world, host_params, status

    def _fetch(self, params: list) -> None:
        import torch

        for p in params:
            p.ds_status = self.status.INFLIGHT
        if self.world == 1 and not self.host:  # NoGatherHandle line 74: .to(device) of a device tensor is itself
            for p in params:
                p.data = p.ds_tensor.view(p.ds_shape)
            return
        before = self.pool.tag
        if self.world == 1 or len(params) == 1:  # a copy per parameter (NoGatherHandle / _all_gather_sequential)
            for p in params:
                self.pool.tag = "params_persistent" if p.ds_persist else "gathered_params"
                buffer = torch.empty(_gathered_numel(p.ds_numel, self.world), dtype=p.dtype)
                p.data = buffer.narrow(0, 0, p.ds_numel).view(p.ds_shape)
        else:  # _all_gather_coalesced: one flat buffer, the parameters views of it
            self.pool.tag = "gathered_params"
            flat = torch.empty(sum(_gathered_numel(p.ds_numel, self.world) for p in params), dtype=params[0].dtype)
            offset = 0
            for p in params:
                p.data = flat.narrow(0, offset, p.ds_numel).view(p.ds_shape)
                offset += _gathered_numel(p.ds_numel, self.world)
        self.pool.tag = before

    def coalesced(self, params, safe_mode: bool = False, quantize: bool = False):
        params = sorted(params, key=lambda q: q.ds_id)
        self._fetch(params)
        return _Handle(params, self.status)

    def now(self, params: list) -> None:
        waiting = [p for p in params if p.ds_status == self.status.NOT_AVAILABLE]
        if waiting:
            self.coalesced(waiting).wait()

    def release(self, params: list, free_data: bool) -> None:
        import torch

        for p in params:
            if free_data:
                p.data = torch.empty(0, dtype=p.dtype)
            p.ds_status = self.status.NOT_AVAILABLE


class _Handle:
    def __init__(self, params: list, status) -> None:
        self.params, self.status, self.done = params, status, False

    def wait(self, **_) -> None:
        if not self.done:
            self.done = True
            for p in self.params:
                p.ds_status = self.status.AVAILABLE


class _Reducer:
    """The stage-3 optimizer's gradient hook (stage3.py reduce_independent_p_g_buckets_and_remove_grads, line
    1569), the bucket's flush (__reduce_and_partition_ipg_grads, line 1648: __avg_scatter_grads, then
    partition_grads, line 2006), for rank 0."""

    def __init__(self, pool: _Pool, mode, world, host_optimizer, prec: Precision, comm, bucket_elems, dtype,
                 contiguous) -> None:
        import torch

        self.pool, self.mode, self.world, self.host, self.prec, self.comm = pool, mode, world, host_optimizer, prec, comm
        self.size, self.contiguous = bucket_elems, contiguous
        self.bucket = torch.empty(bucket_elems if contiguous else 0, dtype=dtype)
        mode.ignore(self.bucket)  # the pool holds it as ipg_bucket (loading)
        self.params: list = []
        self.elements = 0
        self.micro, self.boundary = 0, True
        self.norms: list[int] = []

    def hook(self, p) -> None:
        if self.elements + p.ds_numel > self.size and self.elements > 0:
            self.flush()
        self.pool.retag(self.mode.handle(p.grad), "param_grads")
        n = p.grad.numel()
        if self.contiguous and self.elements + n <= self.size:  # __add_grad_to_ipg_bucket, lines 1635-1640
            view = self.bucket.narrow(0, self.elements, n).view_as(p.grad)
            view.copy_(p.grad)
            p.grad.data = view
        self.params.append(p)
        self.elements += n

    def flush(self) -> None:
        if not self.params:
            return
        pool, prec, world = self.pool, self.prec, self.world
        converted = []
        if self.comm != prec.param:  # __avg_scatter_grads line 1920: the gradients in the communication dtype
            converted = [pool.malloc(p.ds_numel * self.comm, "reduce_buffer") for p in self.params]
        chunks = [stage3_partition_numel(p.ds_numel, world) for p in self.params]
        flat = 0  # reduce_scatter_coalesced: one tensor that divides evenly is reduced in place
        if len(self.params) > 1 or self.params[0].ds_numel % world:
            # line 120: the last rank's chunk of each tensor padded (torch.empty), then line 122: torch.cat
            padding = [pool.malloc((n * world - p.ds_numel) * self.comm, "reduce_buffer")
                       for p, n in zip(self.params, chunks, strict=True)]
            flat = pool.malloc(sum(chunks) * world * self.comm, "reduce_buffer")
            for handle in padding:
                pool.free(handle)
        for handle in converted:
            pool.free(handle)
        partitions = []
        if self.comm != prec.grad_accum:  # line 1944: the partitions in the accumulation dtype
            partitions = [pool.malloc(n * prec.grad_accum, "reduce_buffer") for n in chunks]
        for p, n in zip(self.params, chunks, strict=True):  # partition_grads
            copy = 0
            if self.host:  # the partition comes back to the device (lines 2028, 2034)
                copy = pool.malloc(n * prec.grad_accum, "grad_copies")
            if self.host and self.boundary:  # _offload_grad_partition_at_boundary, line 1443
                norm = 0
                for chunk in range(0, n, NORM_CHUNK):  # part.to(fp64).norm(2): the norm before the copy goes
                    copied = pool.malloc(min(NORM_CHUNK, n - chunk) * 8, "grad_copies")
                    pool.free(norm)
                    norm = pool.malloc(8, "grad_norms")
                    pool.free(copied)
                self.norms.append(norm)
                if prec.master != prec.grad_accum:
                    pool.free(pool.malloc(n * prec.master, "grad_copies"))
            pool.free(copy)
            p.grad = None
        for handle in [flat, *partitions]:
            pool.free(handle)
        self.params, self.elements = [], 0


def _step(offload, pool: _Pool, reducer: _Reducer, host_optimizer, kind, prec: Precision, subs, trained, states,
          world) -> None:
    """stage3.py step (line 2873), for what it allocates on the device."""
    from zerotune.plan.step_peak import _optimizer_temporaries

    offload.partition_all_parameters()  # _partition_all_parameters, line 2878
    if not host_optimizer:
        norms = []  # get_grad_norm_direct: each gradient partition in fp64, one at a time (line 2457)
        for p in trained:
            n = stage3_partition_numel(p.ds_numel, world)
            scratch = pool.malloc(n * 8, "step_norm")
            norms.append(pool.malloc(8, "step_norm"))
            pool.free(scratch)
        for handle in norms:
            pool.free(handle)
        for i, n in enumerate(subs):  # one sub-group at a time
            flat = pool.malloc(n * prec.grad_accum, "step_flatten")  # _prepare_fp32_grad_for_sub_group
            grad = flat
            if prec.master != prec.grad_accum:
                grad = pool.malloc(n * prec.master, "step_fp32_grad")
                pool.free(flat)
            else:
                pool.retag(flat, "step_fp32_grad")
            if i not in states:  # the optimizer's state, at its first step (_optimizer_step, line 1235)
                if kind.layout == "dense":
                    states[i] = [pool.malloc(n * kind.state_elem, "optimizer_states") for _ in range(kind.tensors)]
                else:
                    states[i] = [pool.malloc(optimizer_state(kind, [(n,)]), "optimizer_states")]
            shape = StepShape(3, True, kind.name, prec.param, prec.master, False, n, n, "cuda")
            for temporary in _optimizer_temporaries(shape, "cuda"):
                pool.free(pool.malloc(round(temporary["mib"] * MIB), "optimizer_temporaries"))
            pool.free(grad)  # _release_sub_group, line 2731
    for handle in reducer.norms:  # _post_step: reset_cpu_buffers (line 2536)
        pool.free(handle)
    reducer.norms = []
    if offload.persistent_parameters:  # _post_step, line 2841
        offload.persistent_parameters[0].all_gather(offload.persistent_parameters)

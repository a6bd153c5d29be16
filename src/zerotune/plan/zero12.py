"""ZeRO-1 and ZeRO-2's rules (DeepSpeed 0.19.8's runtime/zero/stage_1_and_2.py): the optimizer's parameters form
one flat group padded to 2 x world size, each rank owning `flat // world` elements of it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerotune.config.schema import MIB, Config, launch_world_size
from zerotune.plan import allocator
from zerotune.plan.gpus import GPU
from zerotune.plan.host_memory import HEAP_KEPT, PINNED_ROUNDING, heap_kept_bytes, rounding_bytes, torch_pins
from zerotune.plan.resolve import ResolvedRun
from zerotune.plan.rules import (
    Precision,
    StepShape,
    buffer_term,
    frozen_numels,
    numels_of,
    offload_device,
    offload_devices,
    optimizer_kind,
    optimizer_state,
    precision_of,
    split_groups,
    states_record,
    term,
    zero_config,
)
from zerotune.rundir.plan import Phase, Plan, Term, mib_of

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
    trained_groups = split_groups(train, groups)
    # step() frees a group's gradients at its turn: ZeRO-2 holds the group's partition, ZeRO-1 its whole grads
    group_grads = [p * prec.param for p in parts] if stage == 2 else [sum(g) * prec.param for g in trained_groups]
    step_groups, step_grads = parts, group_grads
    if stage == 1 and prec.name == "bf16" and prec.grad_accum == 4 and opt_dev == "none":
        # engine._do_optimizer_sanity_check picks BF16_Optimizer here: the same flat partition rule as
        # stage 1 for master and states, but whole fp32 gradients (bf16_optimizer.py:_setup_for_real_optimizer),
        # kept across steps, and one optimizer.step() over every group (bf16_optimizer.py step, line 422).
        group_grads = [zero12_flat(g, world, False, 2) * 4 for g in trained_groups]
        step_groups, step_grads = [part], [sum(group_grads)]
    grads = sum(group_grads)
    host = "host" if opt_dev != "none" else "gpu"  # DeepSpeed offloads stages 1-2 to the CPU only
    # params: the flat group's views and the frozen parameters, each whole (stage_1_and_2.py only
    # flattens the optimizer's param_groups)
    return states_record(sum(numels) * prec.param, grads, part * prec.master, optimizer_state(kind, [(p,) for p in parts]),
                         (prec.param, prec.param, prec.master), kind, trained * prec.param,
                         where={"params": "gpu", "grads": host if stage == 2 else "gpu", "master_weights": host,
                                "optimizer_state": host}, partition_numel=part, step_groups=step_groups,
                         step_group_grads=step_grads)


def _overlap_partition(numels: list[int], part: int, rank: int) -> int:
    """Elements of the whole parameters that touch `rank`'s partition (get_partition_info)."""
    start, end, index, total = part * rank, part * (rank + 1), 0, 0
    for n in numels:
        if start <= index < end or index < start < index + n:
            total += n
        index += n
    return total


def _touching(numels: list[int], part: int, rank: int) -> list[int]:
    """The whole parameters (their sizes) that touch `rank`'s partition of one group (get_partition_info)."""
    start, end, index, found = part * rank, part * (rank + 1), 0, []
    for n in numels:
        if start <= index < end or index < start < index + n:
            found.append(n)
        index += n
    return found


def buffers(ds: dict, numels: list[int], train: list[int], world: int, rank: int | None, prec: Precision,
            zero: DeepSpeedZeroConfig, groups: list[int] | None = None) -> list[Term]:
    stage, offload = int(zero.stage), offload_device(zero.offload_optimizer) != "none"
    trained_groups = split_groups(train, groups)
    # each group's flat buffer and this rank's partition of it: DeepSpeed allocates (and pins) per group
    flats = [zero12_flat(g, world, zero.parameter_alignment, prec.param) for g in trained_groups]
    flat, parts = sum(flats), [f // world for f in flats]
    part, largest, src = flat // world, max(train, default=0), "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer."
    accum_attr = stage == 1 and prec.grad_accum != prec.param  # use_grad_accum_attribute
    terms = [buffer_term("flat_group_padding", (flat - sum(train)) * prec.param, "gpu", "exact", "persistent",
                   src + "__init__ (flatten_dense_tensors_aligned)"),
             buffer_term("allgather_bucket", 0, "gpu", "exact", "step", "runtime/utils.py:all_gather_dp_groups (gathers "
                   "into the flat group in place; allgather_bucket_size only shards the legacy path)")]
    if prec.param != 4:  # the module is built in fp32 on the host; the engine casts it there, then moves it
        terms.append(buffer_term(HEAP_KEPT, heap_kept_bytes(n * prec.param for n in numels), "host", "estimate",
                                 "persistent", "runtime/engine.py:DeepSpeedEngine._cast_module_mixed_precision "
                                 "line 1862 (p.data.to(param_dtype): each parameter's copy, on the host), freed by "
                                 "_configure_distributed_model line 2094 (module.to(device)): the copies under "
                                 "glibc's 32 MiB mmap ceiling stay in its heap (host.py heap_kept_bytes)"))
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
        terms += _offload_host_terms(ds, trained_groups, parts, world, rank, prec, zero, src)
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
    terms.append(buffer_term("step_fp32_grad_partition", max(parts, default=0) * prec.master, "gpu", "exact",
                             "step:update", src + "step lines 3107-3144 (one parameter group at a time: its flattened "
                             "gradient partition cast to the master dtype, freed after its update; the largest group)"))
    return terms


def _offload_host_terms(ds: dict, trained_groups: list[list[int]], parts: list[int], world: int, rank: int | None,
                        prec: Precision, zero: DeepSpeedZeroConfig, src: str) -> list[Term]:
    """What CPU offload holds on the host beyond buffers()' tensors: the pinned allocator's power-of-two blocks
    (`parts`: this rank's partition of each group, in elements), and under gradient accumulation a host gradient
    per parameter of the rank's partition."""
    pinned = bool(zero.offload_optimizer.pin_memory) and torch_pins()
    terms: list[Term] = []
    if pinned:
        largest = max((n for g in trained_groups for n in g), default=0)
        terms += [buffer_term("offload_fp32_master" + PINNED_ROUNDING, rounding_bytes(p * prec.master for p in parts),
                              "host", "exact", "persistent", src + "__init__ line 565 (each group's fp32 master "
                              "partition, the `master_weights` term, pinned: a power-of-two block, pinned.py)"),
                  buffer_term("offload_fp32_grad_partition" + PINNED_ROUNDING,
                              rounding_bytes(p * prec.master for p in parts), "host", "exact", "persistent",
                              src + "initialize_optimizer_states lines 937-941 (each group's fp32 gradient "
                              "partition pinned)"),
                  buffer_term("offload_bit16_param_partition" + PINNED_ROUNDING,
                              rounding_bytes(p * prec.param for p in parts), "host", "exact", "persistent",
                              src + "__init__ lines 568-573 (each group's param_buffer_of_bit16_for_cpu_offload "
                              "pinned)"),
                  buffer_term("offload_temp_grad_host" + PINNED_ROUNDING, rounding_bytes([largest * prec.param]),
                              "host", "exact", "persistent", src + "__init__ lines 653-658 "
                              "(temp_grad_buffer_for_cpu_offload, the largest parameter, pinned)")]
    # async_accumulate_grad_in_cpu_via_gpu (lines 1822-1825, from copy_grads_in_partition when a step has more
    # than one backward): a host gradient per parameter of the partition, in the parameters' dtype, kept in
    # accumulated_grads_in_cpu for the run; not with low-precision masters, nor on the compact fp32 path
    # (_use_compact_grad_partition_buffer: fp32 accumulation of 16-bit parameters)
    compact = prec.grad_accum == 4 and prec.param != 4
    if int(ds.get("gradient_accumulation_steps") or 1) > 1 and prec.master == 4 and not compact:
        def held(r: int) -> list[int]:
            return [n * prec.param for g, p in zip(trained_groups, parts, strict=True) for n in _touching(g, p, r)]

        sizes = max((held(r) for r in (range(world) if rank is None else [rank])),
                    key=lambda s: rounding_bytes(s) + sum(s) if pinned else sum(s))
        bound, what = ("exact" if rank is not None else "upper"), src + "async_accumulate_grad_in_cpu_via_gpu " \
            "lines 1822-1825 (accumulated_grads_in_cpu: each whole parameter touching the rank's partition)"
        terms.append(buffer_term("offload_accumulated_grads_host", sum(sizes), "host", bound, "persistent", what))
        if pinned:
            terms.append(buffer_term("offload_accumulated_grads_host" + PINNED_ROUNDING, rounding_bytes(sizes),
                                     "host", bound, "persistent", what + ", each pinned"))
    return terms


def step_transients(shape: StepShape) -> list[Term]:
    """DeepSpeedZeroOptimizer.step, one parameter group at a time (stage_1_and_2.py lines 3075-3144): its gradients
    flattened and cast (the fp32 partition is buffers()' step_fp32_grad_partition), freed, the group stepped; the
    later groups' gradients are held meanwhile. Each moment is taken at its largest group (an upper bound)."""
    if not shape.use_deepspeed or shape.offloaded:
        return []
    src = "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer.step"
    groups = shape.groups or (shape.trained,)
    grads = shape.group_grads or (0,) * len(groups)
    cast = shape.master_elem if shape.master_elem != shape.param_elem else 0
    # the step:flatten moment counts every group's gradients (step_peak.gradient_terms): group i's own
    # flatten and cast come with the earlier groups' gradients already freed
    flatten = max(n * (shape.param_elem + cast) - sum(grads[:i]) for i, n in enumerate(groups))
    terms = [term("step_flat_grad_partition", flatten, src + " lines 3112-3116 (a group's gradients flattened" +
                  (", then cast" if cast else "") + ", the earlier groups' gradients already freed)", "step:flatten")]
    later = max(sum(grads[i + 1:]) + n * shape.master_elem for i, n in enumerate(groups)) - max(groups) * \
        shape.master_elem
    if later > 0:
        terms.append(term("grads_of_later_groups", later, src + " line 3126 (free_grad_in_param_list frees each "
                          "group's gradients at its turn: the later groups' are held while one group updates)",
                          "step:update"))
    return terms


@dataclass(frozen=True)
class GroupLoad:
    """One parameter group's passage through DeepSpeedZeroOptimizer.__init__ (bytes): at its flatten (step 2) and
    at its clone (step 4, `loading`'s docstring)."""

    group: int
    separate: int      # blocks not yet flattened: the frozen ones and those of later groups
    own: int           # the group's own blocks: alive at the flatten, freed (still reserved) at the clone
    flat: int          # the flat buffers of groups 1..this one
    clone: int         # this group's partition cloned in the run's dtype
    master: int        # the fp32 masters of groups 1..this one on the card (0 under offload)
    earlier_master: int  # those of the groups before this one
    on_gpu: bool       # flattened on the card (else: its blocks moved to the host first)

    @property
    def allocated(self) -> int:
        """The larger of what is allocated at the flatten and at the clone."""
        at_flatten = self.separate + (self.own if self.on_gpu else 0) + self.flat + self.earlier_master
        return max(at_flatten, self.separate + self.flat + self.clone + self.master)

    @property
    def reserved(self) -> int:
        """At the clone: what is allocated, and the group's freed blocks (emptied only at the next group's start)."""
        return self.separate + (self.own if self.on_gpu else 0) + self.flat + self.clone + self.master


def group_loads(groups: list[list[int]], frozen: list[int], param_elem: int, master_elem: int, world: int,
                parameter_alignment: bool, offload: bool, free: float | None,
                held: Callable[[list[int]], int] = allocator.reserved_bytes) -> list[GroupLoad]:
    """Each group's moments, in the order ZeRO-1/2 take them. `held`: what a set of tensor sizes (bytes) holds:
    the CUDA allocator's reservation (default), or their bytes (`sum`, for the CPU's allocator);
    `free`: the card's memory left beside the context (None: taken as fitting)."""
    # the blocks still separate from group i on: counted together, as they share the allocator's segments
    tail = [held([n * param_elem for n in [*frozen, *(x for g in groups[i:] for x in g)]])
            for i in range(len(groups) + 1)]
    flat_numels = [zero12_flat(g, world, parameter_alignment, param_elem) for g in groups]
    flats = [held([n * param_elem]) for n in flat_numels]
    same = param_elem == master_elem  # .to(fp32) of an fp32 clone returns the clone, which is the master
    clones = [0 if (same and not offload) else held([n // world * param_elem]) for n in flat_numels]
    masters = [0 if offload else held([n // world * master_elem]) for n in flat_numels]
    out = []
    for i in range(len(groups)):
        separate, own = tail[i + 1], tail[i] - tail[i + 1]
        on_gpu = free is None or free - tail[i] - sum(flats[:i]) - sum(masters[:i]) >= flats[i]
        out.append(GroupLoad(i, separate, own, sum(flats[:i + 1]), clones[i], sum(masters[:i + 1]),
                             sum(masters[:i]), on_gpu))
    return out


def loading(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, plan: Plan, base: list[Term]) -> Phase:
    """ZeRO-1/2's build, one optimizer parameter group at a time (DeepSpeedZeroOptimizer.__init__), the parameters
    arriving one block each (engine.py module.to). For group i, ZeRO:
    1. empties the cache (line 449): group i-1's freed blocks and clone go back to the driver;
    2. flattens the group into one buffer, on the card when NVML's free memory holds it (line 453), else on the host;
    3. points the parameters into it: the group's blocks are freed, reserved until the next step 1;
    4. clones the rank's partition on the card (line 560), casts it to the fp32 master (on the host under
       offload) and frees the clone.
    The peak is the largest step 4; the trainer's empty_cache at the end carries only live blocks over."""
    prec = precision_of(resolved.ds_config)
    numels, train = numels_of(resolved.model_stats.param_numels, resolved.model_stats.trainable_numels or None)
    groups = split_groups(train, resolved.group_sizes())
    offload = offload_devices(resolved.ds_config)[0] != "none"
    free = None if gpu is None else (gpu.memory_mib - mib_of(base)) * MIB
    loads = group_loads(groups, frozen_numels(numels, train), prec.param, prec.master,
                        launch_world_size(cfg.launch), zero_config(resolved.ds_config).parameter_alignment, offload,
                        free)
    top = max(loads, key=lambda g: g.reserved)
    where = ("no card named: taken as fitting" if gpu is None else f"{gpu.name} holds it") if top.on_gpu else \
        "on the host (the card lacked the room), then moved"
    of = f"group {top.group + 1} of {len(loads)}"
    terms = [*base,
             term("unet_parameter_blocks", top.separate + (top.own if top.on_gpu else 0), "one block per parameter, "
                  f"run dtype (engine.py module.to): the frozen ones and those not yet flattened ({of}'s freed by "
                  "_update_model_bit16_weights, still reserved)"),
             term("flat_parameter_buffer", top.flat, f"{_S12} flatten_dense_tensors_aligned, groups 1..{top.group + 1} "
                  f"({where})"),
             term("master_partition_clone", top.clone, f"{_S12} line 560: {of}'s partition cloned on the card before "
                  f".to(fp32, {'host' if offload else 'GPU'})" if top.clone else "fp32: the clone is the master"),
             term("master_weights", top.master, f"fp32 partitions of groups 1..{top.group + 1} on the card"
                  if top.master else "on the host (the step's term)")]
    last = loads[-1]  # the trainer's empty_cache() after the engine's build returns the last group's blocks, clone
    end = last.separate + last.flat + last.master
    return Phase("loading", mib_of(terms), tuple(terms), end_live_mib=mib_of(base) + end / MIB,
                 freed_at_end_mib=(last.reserved - end) / MIB,
                 source=f"engine.py _configure_distributed_model; {_S12} DeepSpeedZeroOptimizer.__init__, "
                      f"{len(loads)} parameter group(s) (deepspeed.param_groups); empty_cache() at line 449, each "
                      f"group's start, releases what the group before freed and what earlier phases left")

"""ZeRO-3 on a card, replayed allocation by allocation (the engine's build and REPLAY_STEPS steps): DeepSpeed's own
module hooks and parameter coordinator on a fake-tensor model, zero3_runtime.py's stand-ins for the rest, every
storage through a simulator of torch's caching allocator (allocator.TaggedPool), so what ZeRO-3 gathers, keeps
and frees, and the reserve its frees leave, are counted rather than bounded."""

# On the H100 grid (experiments/results/gpu/h100-2026-11-26, SDXL 512 px, bf16, AdamW, one rank, emptied=False)
# the allocated peaks are torch's within 2-34 MiB, the reserved ones within 4 MiB without offload and 60-116 MiB
# above with CPU offload (activations traced through CPU kernels). SDXL's replay takes about 40 s on two cores.

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from typing import Any
from unittest import mock

from zerotune.config.schema import MIB, Config, launch_world_size
from zerotune.plan.allocator import TaggedPool, storage_mode
from zerotune.plan.gpus import GPU
from zerotune.plan.resolve import ResolvedRun
from zerotune.plan.rules import comm_elem, offload_device, optimizer_kind, precision_of, term, zero_config
from zerotune.plan.zero3_runtime import (
    Gather,
    OneStreamAccelerator,
    Reducer,
    as_zero_parameters,
    build_engine,
    in_forward,
    offload_hooks,
    optimizer_step,
    stage3_partition_numel,
    sub_groups,
    zero_numel,
)
from zerotune.rundir.plan import Term

_LOADINGS: dict[str, dict] = {}


def loading_memory(cfg: Config, resolved: ResolvedRun) -> dict:
    """The engine build's replayed device peaks (TaggedPool.record), with "end_reserved": what stays reserved
    once the trainer has emptied the cache after the build."""
    from zerotune.plan import activations

    key = _replay_key(cfg, resolved, "loading")
    if key not in _LOADINGS:
        model = activations._meta_trained(cfg.model, cfg.precision.name, cfg.train.gradient_checkpointing,
                                          cfg.model.attention, cfg.adapter)
        _LOADINGS[key], _ = _build(model, TaggedPool(), cfg, resolved, emptied=True)
    return _LOADINGS[key]


def _build(model, pool: TaggedPool, cfg: Config, resolved: ResolvedRun, emptied: bool) -> tuple[dict, list[int]]:
    """The engine's build on `model` through `pool`: its peaks (TaggedPool.record) with "end_reserved", what stays
    reserved once the trainer empties the cache (`emptied` False: the trainer before d6e1446), and the sub-groups."""
    ds, zero, prec = resolved.ds_config, zero_config(resolved.ds_config), precision_of(resolved.ds_config)
    world = launch_world_size(cfg.launch)
    trained = [p for p in model.parameters() if p.requires_grad]
    subs = sub_groups([stage3_partition_numel(zero_numel(p), world) for p in trained], zero.sub_group_size,
                      resolved.group_sizes())
    build_engine(model, pool, world, offload_device(zero.offload_param) != "none",
                 offload_device(zero.offload_optimizer) != "none", prec, comm_elem(ds, prec.param), zero, subs, trained)
    loading = pool.record()
    if emptied:
        pool.sim.empty_cache()
    loading["end_reserved"] = pool.sim.reserved
    return loading, subs


REPLAY_STEPS = 3        # the kit's runs: step 1 records the module trace, step 2 prefetches, step 3 repeats step 2
REPLAY_FORMAT = 2       # bump when what a replay measures changes: older cache entries then miss
_REPLAYS: dict[str, dict | None] = {}
_ZERO_READ = ("sub_group_size", "reduce_bucket_size", "contiguous_gradients", "prefetch_bucket_size",
              "max_reuse_distance", "max_live_parameters", "param_persistence_threshold",
              "model_persistence_threshold")

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
    "optimizer_temporaries": ("optimizer_temporaries", False, "plan/rules.py optimizer_temporaries, applied to "
                                                              "one sub-group per optimizer.step()"),
}
_MOMENTS = {"carried": "persistent", "loading": "persistent", "forward": "forward+backward",
            "backward": "forward+backward", "step": "step:update"}



def step_memory(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, emptied: bool = True) -> dict | None:
    """The replay's figures for this run on this card, cached: {"loading": peaks, "steps": [peaks per step],
    "seconds", "key"}, each peaks record {"allocated", "reserved" (bytes), "at_allocated_peak"/"at_reserved_peak":
    {"phase", "tags" {tag: bytes}, "cached"}}. None where the replay cannot run (its reason logged). `emptied`
    False: the trainer before it emptied the cache after the engine's build (rows recorded before d6e1446)."""
    from zerotune.config import files
    from zerotune.plan import activations

    family = gpu.family if gpu else "unknown"
    key = _replay_key(cfg, resolved, family) + ("" if emptied else "-kept")
    if key not in _REPLAYS:
        file = activations.cache_dir() / f"zero3-{key}.json"
        found = files.read_json(file)
        if isinstance(found, dict) and found.get("key") == key:
            _REPLAYS[key] = found
        else:
            try:
                _REPLAYS[key] = _replay(cfg, resolved, family, key, emptied)
            except Exception as err:  # noqa: BLE001  # a model or setting the replay cannot run: the rules stand
                logging.getLogger(__name__).warning("ZeRO-3 step replay unavailable (%s: %s); planning from the "
                                                    "rules alone", type(err).__name__, err)
                _REPLAYS[key] = None
            if _REPLAYS[key] is not None:
                files.write_cached_json(file, _REPLAYS[key])
    return _REPLAYS[key]


def step_terms(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, emptied: bool = True) -> list[Term] | None:
    """The step's GPU terms at its replayed reserved peak (the CUDA context aside; predict.predict's in place of
    the rules' sum): what was allocated then, tag by tag, and the cached free blocks (`allocator_reserve`). Model
    states and persistent buffers are `persistent`, the rest carry the peak's moment. None where it cannot run."""
    found = step_memory(cfg, resolved, gpu, emptied)
    if found is None:
        return None
    step = max(found["steps"], key=lambda s: s["reserved"])
    return terms_at(step["at_reserved_peak"], found["optimizer_source"],
                  f"replayed step {found['steps'].index(step) + 1} of {len(found['steps'])}")


def terms_at(at: dict, optimizer_source: str, said: str) -> list[Term]:
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


def _replay_key(cfg: Config, resolved: ResolvedRun, family: str) -> str:
    import deepspeed

    from zerotune.plan import activations
    from zerotune.plan.allocator import CUBLAS_WORKSPACE

    ds = resolved.ds_config
    trace = activations.trace_key(cfg.model, resolved.input_shape, int(ds["train_micro_batch_size_per_gpu"]),
                                  cfg.precision.name, cfg.train.gradient_checkpointing,
                                  cfg.model.attention, cfg.adapter)
    zero = zero_config(ds)
    # the ZeRO settings the replay reads, no more: a tune's candidates that differ elsewhere (overlap_comm, which
    # the replay's one stream does not model) share one replay
    read = {name: getattr(zero, name) for name in _ZERO_READ}
    read["offload"] = [offload_device(zero.offload_param), offload_device(zero.offload_optimizer)]
    what = {"zero": read, "optimizer": ds.get("optimizer"), "client": resolved.client_optimizer,
            "ga": ds["gradient_accumulation_steps"], "world": launch_world_size(cfg.launch),
            "groups": resolved.group_sizes(), "precision": {k: ds.get(k) for k in ("bf16", "fp16", "data_types",
                                                                               "communication_data_type")},
            "clip": ds.get("gradient_clipping"), "cublas": CUBLAS_WORKSPACE.get(family, 0),
            "deepspeed": deepspeed.__version__, "steps": REPLAY_STEPS}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{trace}-{digest}-r{REPLAY_FORMAT}"


def _replay(cfg: Config, resolved: ResolvedRun, family: str, key: str, emptied: bool = True) -> dict:
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerotune.plan import activations

    start = time.perf_counter()
    model = activations._meta_trained(cfg.model, cfg.precision.name, cfg.train.gradient_checkpointing,
                                      cfg.model.attention, cfg.adapter)
    patches: list[Any] = [mock.patch.object(coordinator_module, "print_rank_0", lambda *a, **k: None),
               mock.patch.object(coordinator_module, "assert_ints_same_as_other_ranks", lambda *a, **k: None),
               mock.patch.object(coordinator_module, "get_accelerator", lambda: OneStreamAccelerator),
               mock.patch.object(parameter_offload, "print_rank_0", lambda *a, **k: None)]
    stack = list(parameter_offload.FWD_MODULE_STACK)
    try:
        with contextlib.ExitStack() as context:
            for patch in patches:
                context.enter_context(patch)
            context.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            model.to_empty(device="cpu")
            result = _run(model, cfg, resolved, TaggedPool(), family, emptied)
    finally:
        parameter_offload.FWD_MODULE_STACK[:] = stack
        # __params_to_release is an lru_cache on the class (under instrument_w_nvtx): it would keep the model alive
        cached = coordinator_module.PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
        getattr(cached, "cache_clear", getattr(getattr(cached, "__wrapped__", None), "cache_clear", lambda: None))()
    return {**result, "seconds": round(time.perf_counter() - start, 1), "key": key}


def _run(model, cfg: Config, resolved: ResolvedRun, pool: TaggedPool, family: str, emptied: bool = True) -> dict:
    """The engine's build, then REPLAY_STEPS training steps, on `model` (fake tensors). `emptied`: as _build's
    (False: the trainer the H100 grid ran)."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as status

    from zerotune.plan import activations
    from zerotune.plan.allocator import CUBLAS_WORKSPACE

    ds, zero, prec = resolved.ds_config, zero_config(resolved.ds_config), precision_of(resolved.ds_config)
    world, ga = launch_world_size(cfg.launch), int(ds["gradient_accumulation_steps"])
    host_params = offload_device(zero.offload_param) != "none"
    host_optimizer = offload_device(zero.offload_optimizer) != "none"
    kind = optimizer_kind(ds, host_optimizer, prec, client=resolved.client_optimizer)
    comm, cublas = comm_elem(ds, prec.param), CUBLAS_WORKSPACE.get(family, 0)
    dtype = activations.DTYPES[cfg.precision.name]
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    mode = storage_mode(pool)
    gather = Gather(pool, mode, world, host_params, status)
    as_zero_parameters(params, gather, mode, world, status)
    offload = offload_hooks(model, zero)
    loading, subs = _build(model, pool, cfg, resolved, emptied)
    reducer = Reducer(pool, mode, world, host_optimizer, prec, comm, int(zero.reduce_bucket_size), dtype,
                       bool(zero.contiguous_gradients))
    for p in trained:
        p.register_post_accumulate_grad_hook(reducer.hook)
    steps: list[dict] = []
    states: dict[int, list[int]] = {}
    with mode, torch.enable_grad():
        pool.phase = "forward"
        if cublas:  # the first matmul's workspace, then cuBLASLt's (plan/allocator.py)
            pool.malloc(cublas - MIB, "cublas_workspace")
            pool.malloc(MIB, "cublas_workspace")
        for _ in range(REPLAY_STEPS):
            pool.reset()
            for micro in range(ga):
                pool.phase = "forward"
                reducer.micro, reducer.boundary = micro, micro == ga - 1
                inputs = activations._inputs(cfg.model, resolved.input_shape,
                                             int(resolved.ds_config["train_micro_batch_size_per_gpu"]), dtype)
                in_forward(model, True)  # engine.py _forward_prologue / _forward_epilogue (lines 2955, 2969)
                loss = activations._loss(model, cfg.model, inputs)
                in_forward(model, False)
                pool.phase = "backward"
                loss.backward()
                reducer.flush()  # independent_gradient_partition_epilogue (stage3.py line 1407)
                offload.param_coordinator.release_backward_leftovers()  # backward_epilogue (line 3068)
                if micro == ga - 1:
                    pool.phase = "step"
                    optimizer_step(offload, pool, reducer, host_optimizer, kind, prec, subs, trained, states, world)
                del inputs, loss
            steps.append(pool.record())
    return {"loading": loading, "steps": steps, "optimizer_source": kind.source}

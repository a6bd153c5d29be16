"""DeepSpeed 0.19.8's ZeRO-3 runtime for the replay (zero3_replay.py): partition sizes, persistence, sub-groups,
and stand-ins (DeepSpeed's own need a process group and a CUDA device) that allocate through a TaggedPool what
the lines they name allocate on rank 0's device, in order: gathers, gradient hook, flush, step, engine build."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from zerotune.plan.allocator import TaggedPool
from zerotune.plan.rules import Precision, StepShape, optimizer_state, optimizer_temporaries, split_groups

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

NORM_CHUNK = 250_000_000  # stage3.py _constant_buffered_norm2's buffer_size


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
    """Elements per sub-group (DeepSpeedZeroOptimizer_Stage3._create_fp16sub_groups)."""
    if sub_group_size is None or sub_group_size >= sum(partition_numels):
        return [sum(partition_numels)]
    groups, size = [], 0
    for i, n in enumerate(partition_numels):
        size += n
        if size >= sub_group_size or i == len(partition_numels) - 1:
            groups.append(size)
            size = 0
    return groups


def sub_groups(parts: list[int], sub_group_size: int, groups: list[int] | None) -> list[int]:
    """stage3.py _create_fp16sub_groups, per parameter group: sub-groups never span two groups."""
    return [size for group in split_groups(parts, groups) for size in stage3_sub_groups(group, sub_group_size)]


class OneStreamAccelerator:
    """DeepSpeed's accelerator as the coordinator asks it, answered as one synchronous stream (overlap_comm off:
    the all-gather stream is the default one, parameter_offload.py line 195)."""

    @staticmethod
    def stream(_stream):
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


def in_forward(model, on: bool) -> None:
    """engine.py _forward_prologue/_forward_epilogue: ZeROOrderedDict gathers a parameter read while on."""
    for m in model.modules():
        m._parameters.in_forward = on


def as_zero_parameters(params: list, gather: Gather, mode: Any, world: int, status: Any) -> None:
    """Each parameter given the attributes and methods partition_parameters.py gives a ZeRO parameter
    (_convert_to_deepspeed_param), its data emptied: the partition (ds_tensor) is the pool's to account for."""
    import torch

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


def offload_hooks(model: Any, zero: DeepSpeedZeroConfig) -> Any:
    """parameter_offload.py DeepSpeedZeRoOffload as its __init__ leaves it, with its module hooks and parameter
    coordinator: built without __init__, which would partition the model through a process group."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator_module
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import _init_external_params

    for m in model.modules():
        _init_external_params(m)
    offload = object.__new__(DeepSpeedZeRoOffload)
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
    return offload


def build_engine(model, pool: TaggedPool, world, host_params, host_optimizer, prec: Precision, comm, zero, subs, trained):
    """The engine's build, in order (synthetic: sizes from the fake model)."""
    trained_ids = {id(p) for p in trained}
    partitions = {}
    for m in model.modules():  # zero.Init: each module's tensors built fp32 and cast, then partitioned
        own = list(m.parameters(recurse=False))
        built = []
        for p in own:
            fp32 = pool.malloc(zero_numel(p) * 4, "loading")
            if prec.param != 4:
                built.append(pool.malloc(zero_numel(p) * prec.param, "loading"))
                pool.free(fp32)
            else:
                built.append(fp32)
        for p in own:  # _partition_param line 1836: the partition on the GPU unless the parameters are offloaded
            if not host_params:
                tag = "frozen_params" if id(p) not in trained_ids else "loading"
                partitions[id(p)] = pool.malloc(stage3_partition_numel(zero_numel(p), world) * prec.param, tag)
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
            pool.free(pool.malloc(_gathered_numel(zero_numel(p), world) * prec.param, "loading"))


def zero_numel(p) -> int:
    """A parameter's elements: its ZeRO size once the replay has emptied it, else its own."""
    return getattr(p, "ds_numel", None) or p.numel()


def _gathered_numel(numel: int, world: int) -> int:
    return stage3_partition_numel(numel, world) * world


class Gather:
    """What the coordinator calls on parameters: all_gather_coalesced (a handle whose wait() makes them AVAILABLE,
    once, for all of them, as AllGatherCoalescedHandle), all_gather, partition (free_param)."""

    def __init__(self, pool: TaggedPool, mode, world: int, host_params: bool, status) -> None:
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
        return Handle(params, self.status)

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


class Handle:
    def __init__(self, params: list, status) -> None:
        self.params, self.status, self.done = params, status, False

    def wait(self, **_) -> None:
        if not self.done:
            self.done = True
            for p in self.params:
                p.ds_status = self.status.AVAILABLE


class Reducer:
    """The stage-3 optimizer's gradient hook (stage3.py reduce_independent_p_g_buckets_and_remove_grads, line
    1569), the bucket's flush (__reduce_and_partition_ipg_grads, line 1648: __avg_scatter_grads, then
    partition_grads, line 2006), for rank 0."""

    def __init__(self, pool: TaggedPool, mode, world, host_optimizer, prec: Precision, comm, bucket_elems, dtype,
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


def optimizer_step(offload, pool: TaggedPool, reducer: Reducer, host_optimizer, kind, prec: Precision, subs, trained, states,
          world) -> None:
    """stage3.py step (line 2873), for what it allocates on the device."""
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
            for temporary in optimizer_temporaries(shape, "cuda"):
                pool.free(pool.malloc(temporary.nbytes, "optimizer_temporaries"))
            pool.free(grad)  # _release_sub_group, line 2731
    for handle in reducer.norms:  # _post_step: reset_cpu_buffers (line 2536)
        pool.free(handle)
    reducer.norms = []
    if offload.persistent_parameters:  # _post_step, line 2841
        offload.persistent_parameters[0].all_gather(offload.persistent_parameters)

"""Plain accelerate and ZeRO-0's rules, nothing partitioned: DeepSpeed's all-reduce bucket and fp32 gradient copies;
plain accelerate's fp32 weights and gradients, its own buffers (plain_buffers: accumulated gradients, DDP's
buckets), and CUDA autocast's cast policy for tracing its step."""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotune.config.schema import DTYPE_BYTES, Config, launch_world_size
from zerotune.plan import allocator
from zerotune.plan.gpus import GPU
from zerotune.plan.resolve import ResolvedRun
from zerotune.plan.rules import (
    Precision,
    StepShape,
    buffer_term,
    comm_elem,
    module_blocks,
    numels_of,
    optimizer_kind,
    optimizer_state,
    split_groups,
    states_record,
    term,
)
from zerotune.rundir.plan import Phase, Plan, Term, mib_of

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
    import torch
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig


def states(numels: list[int], train: list[int], ds: dict, world: int, prec: Precision,
           zero: DeepSpeedZeroConfig | None, plain: bool = False, client: dict | None = None,
           shapes: list[tuple[int, ...]] | None = None, groups: list[int] | None = None) -> dict:
    """`plain`: plain accelerate, torch's optimizer on fp32 weights (model_states.py gives it fp32 `prec`).
    `shapes`: the trained parameters' shapes (Adafactor factors by shape); None: each taken as 1-D."""
    kind, trained = optimizer_kind(ds, False, prec, plain, client), sum(train)
    each: list[tuple[int, ...]] = shapes if shapes is not None else [(n,) for n in train]
    stepped: list[tuple[int, ...]]
    if prec.name == "fp32":  # the basic optimizer steps the parameters themselves
        master, stepped = 0, each
    else:  # FP16_Optimizer (FusedAdam: one flat fp32 copy) or FP16_UnfusedOptimizer (an fp32 copy per tensor)
        flats: list[tuple[int, ...]] = [(sum(g),) for g in split_groups(train, groups)]  # one per parameter group
        master, stepped = trained * 4, flats if kind.name == "FusedAdam" else each
    kind = dataclasses.replace(kind, state_elem=4 if kind.layout == "dense" else kind.state_elem)  # fp32 tensors
    return states_record(sum(numels) * prec.param, trained * prec.param, master, optimizer_state(kind, stepped),
                         (prec.param, prec.param, 4), kind, trained * prec.param)


# A later micro-step's forward and backward under gradient accumulation (step_peak.MOMENTS).
ACCUMULATING = "forward+backward:accumulating"
PLAIN_GRAD_ELEM = 4  # plain accelerate's gradients: fp32, like the weights (model_states.py _PLAIN)


def ddp_wraps(world: int, device: str) -> bool:
    """Whether accelerate wraps the module in DDP (accelerator.py prepare_model): on CUDA with several processes;
    on a CPU whenever LOCAL_RANK is set (state.py: MULTI_CPU wraps at any process count), which zerotune's
    environment always sets (train/distributed.py ensure_single_process_env)."""
    return world > 1 or device == "cpu"


def plain_buffers(ds: dict, train: list[int], world: int, device: str = "cuda") -> list[Term]:
    """torch's and accelerate's own memory beside plain accelerate's model states, on the training device.
    `device`: cuda (a card) or cpu (this machine's CPU run): where accelerate wraps the module in DDP."""
    grads = sum(train) * PLAIN_GRAD_ELEM
    terms = []
    if int(ds.get("gradient_accumulation_steps", 1)) > 1:
        terms.append(buffer_term(
            "accumulated_grads", grads, "gpu", "exact", ACCUMULATING,
            "param.grad of the earlier micro-steps, held through the next forward and backward: inside "
            "accelerate's Accelerator.accumulate the trainer's optimizer.step() and zero_grad() do nothing until "
            "sync_gradients (accelerate/optimizer.py AcceleratedOptimizer.step/zero_grad), and backward adds each "
            "new gradient into them in place (torch/csrc/autograd/functions/accumulate_grad.h AccumulateGrad)"))
    if ddp_wraps(world, device):
        from torch.distributed import _DEFAULT_FIRST_BUCKET_BYTES
        from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB

        terms.append(buffer_term(
            "ddp_gradient_buckets", grads, "gpu", "exact", "persistent",
            "torch/nn/parallel/distributed.py DistributedDataParallel._ddp_init_helper -> dist.Reducer "
            "(torch/csrc/distributed/c10d/reducer.cpp Reducer::initialize_buckets): one flat gradient tensor per "
            "bucket, every trained gradient copied in and reduced there, gradient_as_bucket_view=False (accelerate's "
            "DistributedDataParallelKwargs default): a second copy of the gradients for the whole run. Built as one "
            "bucket (find_unused_parameters=False: bucket_size_limits [sys.maxsize]), re-cut after the first "
            f"iteration (Reducer::rebuild_buckets, the old ones cleared first) into {_DEFAULT_BUCKET_CAP_MB} MiB "
            f"buckets (bucket_cap_mb) with a first of {_DEFAULT_FIRST_BUCKET_BYTES // 2**20} MiB "
            "(dist._DEFAULT_FIRST_BUCKET_BYTES): the same bytes"))
    return terms


DDP_BROADCAST_BUCKET = 250 * 2**20  # DistributedDataParallel.__init__: self.broadcast_bucket_size


def ddp_broadcast_bytes(numels: list[int], elem: int, cap: int = DDP_BROADCAST_BUCKET) -> int:
    """DDP's broadcast of the parameters at construction (_sync_module_states -> broadcast_coalesced): flattened in
    order into buckets closing at `cap` bytes, two in flight at once: the largest two consecutive buckets."""
    buckets, filling = [], 0
    for n in numels:
        filling += n * elem
        if filling >= cap:
            buckets.append(filling)
            filling = 0
    if filling:
        buckets.append(filling)
    return max((a + b for a, b in itertools.pairwise(buckets)), default=sum(buckets))


def buffers(ds: dict, numels: list[int], train: list[int], world: int, rank: int | None, prec: Precision,
            zero: DeepSpeedZeroConfig, groups: list[int] | None = None) -> list[Term]:
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    # A bucket closes once it passes MEMORY_OPT_ALLREDUCE_SIZE elements; it is cast when the comm dtype differs.
    bucket = min(sum(train), MEMORY_OPT_ALLREDUCE_SIZE + max(train, default=0))
    comm = comm_elem(ds, prec.param)
    return [buffer_term("allreduce_flat_bucket", bucket * (prec.param + (comm if comm != prec.param else 0)), "gpu",
                        "upper", "reduce", "runtime/engine.py:DeepSpeedEngine.allreduce_no_retain / allreduce_bucket "
                        "(flattens gradients in buckets of MEMORY_OPT_ALLREDUCE_SIZE elements)")]


def step_transients(shape: StepShape) -> list[Term]:
    """DeepSpeed's ZeRO-0 optimizer wrappers step fp32 copies of lower-precision gradients (plain accelerate: none)."""
    if not shape.use_deepspeed or shape.param_elem == shape.master_elem:
        return []
    if shape.optimizer == "FusedAdam":  # the cast copies and their flat copy, then the flat one alone
        src = "runtime/fp16/fused_optimizer.py:FP16_Optimizer.step"
        return [term("step_fp32_grads", shape.trained * 8, src + ": every gradient cast to fp32 and flattened "
                     "(_flatten_dense_tensors), both held at once", "step:flatten"),
                term("step_fp32_grads", shape.trained * 4, src + ": the flat fp32 gradients", "step:update")]
    return [term("step_fp32_grads", shape.trained * 4,
                 "runtime/fp16/unfused_optimizer.py:FP16_UnfusedOptimizer.step: an fp32 copy of every gradient",
                 "step:update")]


def loading(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, plan: Plan, base: list[Term]) -> Phase:
    """Stage 0: the module cast on the host, then moved one block per parameter. Plain accelerate moves the fp32
    module as it is, then with several processes wraps it in DDP (its buckets, the parameters' broadcast)."""
    if resolved.use_deepspeed:
        sizes, _ = module_blocks(resolved, DTYPE_BYTES[cfg.precision.name])
        terms = [*base, term("unet_parameters", allocator.reserved_bytes(sizes),
                             "one block per parameter, run dtype (engine.py _configure_distributed_model module.to)")]
        return Phase("loading", mib_of(terms), tuple(terms),
                source="engine.py _configure_distributed_model; the optimizer's copies are the step's terms")
    sizes, _ = module_blocks(resolved, PLAIN_GRAD_ELEM)
    terms = [*base, term("unet_parameters", allocator.reserved_bytes(sizes), "one block per parameter, fp32 "
                         "(accelerate/accelerator.py prepare_model: model.to(device))")]
    world = launch_world_size(cfg.launch)
    if ddp_wraps(world, "cuda"):
        numels, train = numels_of(resolved.model_stats.param_numels, resolved.model_stats.trainable_numels or None)
        terms += [term(t.term, t.nbytes, t.note) for t in plain_buffers({}, train, world)]
        terms.append(term("ddp_broadcast_buckets", ddp_broadcast_bytes(numels, PLAIN_GRAD_ELEM),
                          "torch/distributed/utils.py _sync_module_states -> dist._broadcast_coalesced "
                          "(DistributedDataParallel.__init__): the parameters flattened into 250 MiB buckets, two in "
                          "flight (transient)"))
    return Phase("loading", mib_of(terms), tuple(terms),
            source="accelerate/accelerator.py prepare_model (model.to, then DistributedDataParallel with several "
                      "processes); the optimizer's states are the step's terms")


# Plain accelerate's autocast: activations.py traces its step on CPU tensors; for a plan on a card the casts are
# CUDA autocast's, read from torch's own header (torch is imported where a rule needs it, as DeepSpeed is).

_POLICY_LISTS = {"AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp", "AT_FORALL_FP32": "fp32",
                 "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype", "AT_FORALL_PROMOTE": "promote"}


def autocast_header() -> Path:
    """torch's own ATen/autocast_mode.h, shipped with the installed torch (its C++ headers)."""
    import torch

    return Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def cuda_autocast_policies() -> dict[str, str]:
    """{"aten::op" or "aten::op.overload": cast policy} for CUDA tensors, from the op lists of the installed
    torch's ATen/autocast_mode.h. CPU's autocast has its own (group_norm, layer_norm, softmax and upsampling run
    in fp32 on CUDA, in the autocast dtype on a CPU)."""
    header = autocast_header()
    if not header.is_file():
        raise FileNotFoundError(f"{header}: this torch ships no C++ headers; CUDA's autocast op lists are there")
    text = header.read_text()
    found: dict[str, str] = {}
    for macro, policy in _POLICY_LISTS.items():
        body = re.search(rf"#define {macro}\(_\)((?:[^\n]*\\\n)*[^\n]*)", text)
        if body is None:
            raise ValueError(f"{header}: no {macro} list")
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1)):
            found[f"aten::{name}" + (f".{overload}" if overload else "")] = policy
    return found


@contextmanager
def cast_policy(device: str | None) -> Iterator[None]:
    """Inside, for device "cuda": CPU tensors under CPU autocast are cast as CUDA's autocast casts CUDA tensors
    (kernels on the AutocastCPU key, removed on exit); nothing changes otherwise."""
    if device != "cuda":
        yield
        return
    import torch

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": each such override is meant
            warnings.simplefilter("ignore")
            for op, kernel in _cuda_policy_kernels():
                lib.impl(op, kernel, "AutocastCPU")
        yield
    finally:
        lib._destroy()


def _cuda_policy_kernels() -> Iterator[tuple[Any, Any]]:
    import torch

    on_cpu = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    on_cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    for name, policy in cuda_autocast_policies().items():
        if policy == "lower_precision_fp" and name in on_cpu:
            continue
        op = _overload(name)
        if op is not None:
            yield op, _policy_kernel(op, policy)
    for name in sorted(on_cpu - on_cuda):  # CPU-only rules (cat's promote, fp32 for cdist, fft ...): CUDA's none
        op = _overload(name)
        if op is not None:
            yield op, _policy_kernel(op, None)


def _overload(name: str) -> Any:
    import torch

    op, _, overload = name.removeprefix("aten::").partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


def _policy_kernel(op: Any, policy: str | None) -> Any:
    """autocast_mode.h's WrapFunction_ for `policy` (None: fall through), on CPU tensors: under the excluded autocast
    key, each eligible argument (a floating CPU tensor, not fp64: is_eligible) cast, then the op."""
    import torch

    autocast_cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype") if policy == "fp32_set_opt_dtype" and "dtype" in names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(autocast_cpu):
            if policy is None:
                return op(*args, **kwargs)
            if policy == "fp32_set_opt_dtype":  # set_opt_dtype: an unset output dtype becomes fp32
                if dtype_at is not None and args and _eligible(args[0]):
                    if dtype_at < len(args):
                        if args[dtype_at] is None:
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            lower = torch.get_autocast_dtype("cpu")
            to = {"fp32": torch.float32, "lower_precision_fp": lower}.get(policy) or _promoted(lower, args, kwargs)
            return op(*_cast_to(args, to), **_cast_to(kwargs, to))

    return kernel


def _eligible(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_floating_point() and \
        value.dtype != torch.float64


def _promoted(lower: torch.dtype, args: tuple, kwargs: dict) -> torch.dtype:
    import torch

    to = lower
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if _eligible(t):
                to = torch.promote_types(to, t.dtype)
    return to


def _cast_to(value: Any, to: torch.dtype) -> Any:
    if isinstance(value, dict):
        return {k: _cast_to(v, to) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_to(v, to) for v in value)
    return value.to(to) if _eligible(value) and value.dtype != to else value

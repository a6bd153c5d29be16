"""What every ZeRO stage's rules (stage0.py, zero12.py, zero3.py) read from the validated DeepSpeed dict, the
way DeepSpeed 0.19.8's engine reads it: the precision of each kind of tensor, the optimizer it builds, where
an offload device puts a tensor; and the shapes the rules answer in (a state record, a Term)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerotune.config.schema import DTYPE_BYTES
from zerotune.plan.resolve import ResolvedRun
from zerotune.rundir.plan import Plan, Term

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

FP32_STEP_BYTES = 4  # torch optimizers keep `step` as a 0-d float32 tensor per optimized tensor


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
    """The optimizer class DeepSpeed builds (engine._configure_basic_optimizer), or the client one zerotune
    hands it, and what its state holds per optimized tensor."""

    name: str
    tensors: int           # state tensors per optimized tensor, each of its size (dense layout)
    state_elem: int        # bytes per element of those tensors
    torch_step: bool       # torch's own optimizers add a 0-d float32 `step` tensor
    layout: str = "dense"  # dense | adafactor | blockwise8bit: how the state follows a tensor's shape
    source: str = "runtime/engine.py:DeepSpeedEngine._configure_basic_optimizer"  # the line that allocates it


@dataclass(frozen=True)
class StepShape:
    """What decides the step's transients."""

    stage: int
    use_deepspeed: bool
    optimizer: str           # model_states' OptimizerKind.name: torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam, ...
    param_elem: int          # bytes per element: parameters (and their gradients), master weights
    master_elem: int
    offloaded: bool          # the optimizer's states on the host (or NVMe)
    trained: int             # elements the optimizer updates on this rank
    largest_trained: int     # the largest tensor it steps at once: a parameter, the flat partition, a sub-group
    device: str              # cuda | cpu
    # ZeRO-1/2: the optimizer's calls, one per parameter group (stage_1_and_2.py step's loop), in order: each
    # group's partition (elements) and the gradient bytes the group holds until its turn frees them
    groups: tuple[int, ...] = ()
    group_grads: tuple[int, ...] = ()
    # the reduce bucket holds every trained gradient: it is flushed once, after backward (ZeRO-2's and ZeRO-3's
    # gradient partitions are filled then, not while the activations are held)
    one_flush: bool = False


def dtype_bytes(value: Any) -> int:
    """Bytes per element of a dtype as the DeepSpeed dict spells it (fp32, "torch.bfloat16", "half", ...)."""
    from deepspeed.runtime.config import DtypeEnum

    return DTYPE_BYTES[DtypeEnum(value).name]


def precision_of(ds_config: dict) -> Precision:
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    bf16, fp16 = get_bfloat16_config(ds_config), get_float16_config(ds_config)
    name = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    master = ("fp16" if fp16.fp16_master_weights_and_grads else
              "bf16" if bf16.bf16_master_weights_and_grads else "fp32")
    return Precision(name, DTYPE_BYTES[name], dtype_bytes(accum) if accum else DTYPE_BYTES[name], DTYPE_BYTES[master],
                     bool(bf16.bf16_optimizer_states))


def zero_config(ds_config: dict) -> DeepSpeedZeroConfig:
    """DeepSpeed's own parse of `zero_optimization`: its defaults and aliases (stage3_* names, overlap_comm)."""
    from deepspeed.runtime.zero import config

    return config.DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))


def offload_device(block: Any) -> str:
    device = getattr(block, "device", None) if block is not None else None
    return "none" if device is None else str(getattr(device, "value", device))


def offload_devices(ds: dict) -> tuple[str, str]:
    """(optimizer, parameters) offload devices as the dict names them: none | cpu | nvme."""
    zero = ds.get("zero_optimization", {})
    return ((zero.get("offload_optimizer") or {}).get("device", "none"),
            (zero.get("offload_param") or {}).get("device", "none"))


def place(device: str) -> str:
    """Where an offload device puts a tensor: cpu -> host memory; nvme -> swap files (pinned host buffers)."""
    return {"none": "gpu", "cpu": "host"}.get(device, device)


def client_kind(client: dict, prec: Precision) -> OptimizerKind:
    """A client optimizer's state, as its class allocates it (torch's: in the master weights' dtype)."""
    name, params = client["name"], client["params"]
    if name == "adafactor":
        # transformers/optimization.py Adafactor.step: exp_avg (beta1 set) and exp_avg_sq or its row and column
        # factors, fp32 (`.to(grad)` of the fp32 gradient), and `RMS`, a 0-d fp32 tensor; `step` is an int.
        return OptimizerKind("transformers.Adafactor", 1 if params.get("beta1") is None else 2, 4, False, "adafactor",
                             "transformers/optimization.py:Adafactor.step (state initialisation; _get_options "
                             "factors 2-D and larger tensors only)")
    if name == "adamw8bit":
        # bitsandbytes/optim/optimizer.py Optimizer2State.init_state: uint8 state1/state2, fp32 absmax per block
        # of 256; below min_8bit_size (4096) elements, fp32 state1/state2; `step` is an int.
        return OptimizerKind("bitsandbytes.AdamW8bit", 2, 1, False, "blockwise8bit",
                             "bitsandbytes/optim/optimizer.py:Optimizer2State.init_state (uint8 state1/state2, "
                             "fp32 absmax per 256 elements)")
    if name == "torch_adamw":  # torch/optim/adamw.py _init_group: exp_avg, exp_avg_sq like the parameter
        return OptimizerKind("torch.optim.AdamW", 2, prec.master, True, source="torch/optim/adamw.py:AdamW._init_group")
    if name == "sgd":  # torch/optim/sgd.py: momentum_buffer like the parameter (none without momentum)
        return OptimizerKind("torch.optim.SGD", 1 if params.get("momentum") else 0, prec.master, False,
                             source="torch/optim/sgd.py:SGD.step (momentum_buffer)")
    raise ValueError(f"no memory rule for client optimizer {name!r}")


def optimizer_kind(ds_config: dict, offloaded: bool, prec: Precision, plain: bool = False,
                   client: dict | None = None) -> OptimizerKind:
    """`client`: the optimizer zerotune hands the engine (ResolvedRun.client_optimizer), if any."""
    if client is not None:
        return client_kind(client, prec)
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


BNB_BLOCK = 256           # bitsandbytes/optim/optimizer.py Optimizer2State.init_state: blocksize = 256
BNB_MIN_8BIT_SIZE = 4096  # Optimizer2State.__init__ min_8bit_size default
BNB_QMAPS_BYTES = 2 * 256 * 4  # name2qmap "dynamic" and "udynamic": 256 fp32 each, one pair per device


def optimizer_state(kind: OptimizerKind, shapes: list[tuple[int, ...]]) -> int:
    """Optimizer state bytes for optimized tensors of these shapes (the parameters, or DeepSpeed's 1-D partitions)."""
    total = sum(_tensor_state(kind, shape) for shape in shapes)
    if kind.layout == "blockwise8bit" and any(math.prod(s) >= BNB_MIN_8BIT_SIZE for s in shapes):
        total += BNB_QMAPS_BYTES
    return total


def _tensor_state(kind: OptimizerKind, shape: tuple[int, ...]) -> int:
    n = math.prod(shape)
    if kind.layout == "adafactor":
        # factored when the tensor has 2 or more dimensions (_get_options): rows shape[:-1], columns
        # shape[:-2] + shape[-1:]; the flat partitions ZeRO 1-3 hand it are 1-D, so never factored there
        second = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if len(shape) >= 2 else n
        return (second + (n if kind.tensors == 2 else 0)) * kind.state_elem + 4  # + RMS
    if kind.layout == "blockwise8bit":
        if n < BNB_MIN_8BIT_SIZE:
            return 2 * n * 4
        return 2 * n + 2 * -(-n // BNB_BLOCK) * 4
    return kind.tensors * n * kind.state_elem + (FP32_STEP_BYTES if kind.torch_step else 0)


def numels_of(param_numels: Any, trainable_numels: Any = None) -> tuple[list[int], list[int]]:
    """Every parameter's size and the optimizer's (None: all), as lists of ints."""
    numels = [int(n) for n in param_numels]
    return numels, numels if trainable_numels is None else [int(n) for n in trainable_numels]


def split_groups(train: list[int], groups: list[int] | None) -> list[list[int]]:
    """The optimizer's parameter groups: `train` cut into runs of `groups[i]` parameters (one group when None or
    empty). ZeRO flattens, pads and partitions each group on its own."""
    if not groups:
        return [train]
    out, start = [], 0
    for size in groups:
        out.append(train[start:start + size])
        start += size
    if start != len(train):
        raise ValueError(f"parameter groups of {sum(groups)} parameters for {len(train)} trained ones")
    return out


ON_GPU = dict.fromkeys(("params", "grads", "master_weights", "optimizer_state"), "gpu")


def states_record(params: int, grads: int, master: int, state: int, elem: tuple[int, int, int], kind: OptimizerKind,
                  trainable: int, where: dict = ON_GPU, **extra: Any) -> dict:
    """One rank's model states: bytes, where each lives, element sizes (params, grads, master), the optimizer."""
    return {"params_bytes": params, "grads_bytes": grads, "master_weights_bytes": master,
            "optimizer_state_bytes": state, "where": where,
            "elem_bytes": {**dict(zip(("params", "grads", "master_weights"), elem, strict=True)),
                           "optimizer_state": kind.state_elem},
            "optimizer": kind.name, "optimizer_source": kind.source, "params_persistent_bytes": 0, "master_weights_alias_params": False,
            "trainable_params_bytes": trainable, **extra}


def term(name: str, nbytes: float, note: str = "", moment: str | None = None) -> Term:
    """A memory term of the plan."""
    return Term.of_bytes(name, nbytes, note, moment)


def buffer_term(name: str, nbytes: int, where: str, bound: str, lifetime: str, source: str,
                overlaps: str = "") -> Term:
    """One of DeepSpeed's buffers: where it lives, exact or upper bound, its lifetime (persistent | backward |
    forward+backward | reduce | step[:flatten|:update]), its source line, the model state it overlaps, if any."""
    return Term.of_bytes(name, int(nbytes), source, lifetime, where=where, bound=bound, overlaps=overlaps)


def comm_elem(ds: dict, param_elem: int) -> int:
    """engine.communication_data_type: the dict's value, else the parameters' dtype."""
    value = ds.get("communication_data_type")
    return dtype_bytes(value) if value else param_elem


def state_mib(plan: Plan, name: str) -> float:
    """A GPU term of the step's prediction by name (0 when the term is not on the GPU)."""
    return sum(t.mib or 0.0 for t in plan.gpu_terms if t.term == name)


def zero_stage(resolved: ResolvedRun) -> int:
    return int(resolved.ds_config["zero_optimization"]["stage"]) if resolved.use_deepspeed else 0


def frozen_numels(numels: list[int], trainable: list[int]) -> list[int]:
    """The sizes of the parameters the optimizer does not get (as a multiset: order does not matter here)."""
    left = Counter(trainable)
    frozen = []
    for n in numels:
        if left[n]:
            left[n] -= 1
        else:
            frozen.append(n)
    return frozen


def module_blocks(resolved: ResolvedRun, elem: int) -> tuple[list[int], list[int]]:
    """(every parameter's bytes, the frozen ones'), in the run's dtype: module.to(device) gives each its own block."""
    numels, trainable = numels_of(resolved.model_stats.param_numels, resolved.model_stats.trainable_numels or None)
    frozen = frozen_numels(numels, trainable)
    return [n * elem for n in numels], [n * elem for n in frozen]


def optimizer_temporaries(shape: StepShape, device: str) -> list[Term]:
    """What the optimizer's step allocates and frees beyond its states, on `device` (cuda: foreach kernels)."""
    if shape.optimizer == "transformers.Adafactor":
        # Adafactor.step, one tensor at a time: `update` (grad**2 + eps) is alive while the second moment's
        # rsqrt (or the factors' product) makes the next one, and again while `-update` is added to the weights
        return [term("optimizer_temporaries", 2 * shape.largest_trained * 4,
                     "transformers/optimization.py Adafactor.step: two fp32 copies of the largest tensor it steps "
                     "(the flat partition under ZeRO)", "step:update")]
    if not shape.optimizer.startswith("torch.optim."):
        return []  # FusedAdam/FusedLion (CUDA), DeepSpeed's CPU ops and bitsandbytes' kernels update in place
    kind = shape.optimizer.rsplit(".", 1)[1]
    module = "adagrad" if kind == "Adagrad" else "adam"  # torch's AdamW is adam.py's Adam, decoupled
    per_tensor = {"AdamW": 2, "Adam": 2, "Adagrad": 1}.get(kind, 0)
    if not per_tensor:
        return []
    # what one optimizer.step() call updates: everything at stage 0, one group (ZeRO-1/2) or sub-group (ZeRO-3)
    per_call = shape.trained if not shape.use_deepspeed or shape.stage == 0 else shape.largest_trained
    if device == "cuda":  # foreach: one new tensor per optimized tensor, all at once
        return [term("optimizer_temporaries", per_call * shape.master_elem,
                     f"torch/optim/{module}.py ({kind}), foreach on CUDA tensors: torch._foreach_sqrt of the states",
                     "step:update")]
    what = "exp_avg_sq.sqrt() / bias_correction2_sqrt" if per_tensor == 2 else "state_sum.sqrt()"
    return [term("optimizer_temporaries", per_tensor * shape.largest_trained * shape.master_elem,
                 f"torch/optim/{module}.py ({kind}), one tensor at a time on CPU tensors: {what} of the largest one",
                 "step:update")]

"""Plain accelerate and ZeRO-0's rules: nothing is partitioned; DeepSpeed adds its gradient all-reduce bucket and
the step's fp32 gradient copies."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from zerotune.plan import allocator
from zerotune.plan.gpus import GPU
from zerotune.plan.rules import (
    Precision,
    StepShape,
    buffer_term,
    comm_elem,
    module_blocks,
    optimizer_kind,
    optimizer_state,
    split_groups,
    states_record,
    term,
)
from zerotune.resolved import ResolvedRun
from zerotune.rundir.plan import Term
from zerotune.schema import Config
from zerotune.units import DTYPE_BYTES

if TYPE_CHECKING:  # DeepSpeed is imported where a rule needs it: reading a plan does not
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


def buffers(ds: dict, numels: list[int], train: list[int], world: int, rank: int | None, prec: Precision,
            zero: DeepSpeedZeroConfig, groups: list[int] | None = None) -> list[Term]:
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    # A bucket closes once it passes MEMORY_OPT_ALLREDUCE_SIZE elements; it is cast when the comm dtype differs.
    bucket = min(sum(train), MEMORY_OPT_ALLREDUCE_SIZE + max(train, default=0))
    comm = comm_elem(ds, prec.param)
    return [buffer_term("allreduce_flat_bucket", bucket * (prec.param + (comm if comm != prec.param else 0)), "gpu",
                        "upper", "reduce", "runtime/engine.py:DeepSpeedEngine.allreduce_no_retain / allreduce_bucket "
                        "(flattens gradients in buckets of MEMORY_OPT_ALLREDUCE_SIZE elements)")]


def step_transients(shape: StepShape) -> list[dict]:
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


def loading(cfg: Config, checked: ResolvedRun, gpu: GPU | None, plan: dict, base: list[dict]) -> dict:
    """Stage 0 / plain accelerate: the module cast and moved parameter by parameter (engine.py
    _configure_distributed_model: _cast_module_mixed_precision on the host, then module.to(device))."""
    sizes, _ = module_blocks(checked, DTYPE_BYTES[cfg.precision.name])
    terms = [*base, term("unet_parameters", allocator.reserved_bytes(sizes),
                         "one block per parameter, run dtype (engine.py _configure_distributed_model module.to)")]
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms,
            "source": "engine.py _configure_distributed_model; the optimizer's copies are the step's terms"}

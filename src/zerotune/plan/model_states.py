"""Per-rank model states (parameters, gradients, master weights, optimizer states) and buffers, predicted from the
parameter sizes and the validated DeepSpeed dict: the entry points over each stage family's rules (stage0.py,
zero12.py, zero3.py: DeepSpeed 0.19.8's own, padding included, read from its source)."""

from __future__ import annotations

from types import ModuleType

from zerotune.config.schema import Adapter, Model
from zerotune.plan import stage0, zero3, zero12
from zerotune.plan.rules import Precision, numels_of, precision_of, zero_config
from zerotune.rundir.plan import Term


def rules_for(stage: int) -> ModuleType:
    """The module holding stage `stage`'s rules (0 also for plain accelerate: nothing partitioned)."""
    return {0: stage0, 1: zero12, 2: zero12, 3: zero3}[stage]


# Plain accelerate keeps fp32 weights (autocast for bf16/fp16) and builds torch's optimizer on them.
_PLAIN = Precision("fp32", 4, 4, 4, False)


def model_state_bytes(param_numels: list[int], ds_config: dict, world_size: int, rank: int,
                      use_deepspeed: bool, trainable_numels: list[int] | None = None,
                      client_optimizer: dict | None = None,
                      trainable_shapes: list[tuple[int, ...]] | None = None,
                      trainable_groups: list[int] | None = None) -> dict:
    """This rank's bytes of parameters, gradients, master weights and optimizer states as train/engine.py's
    `partition_bytes` reads them after step 1, with `where` each lives (gpu | host) and the element sizes.
    `param_numels`: every parameter, in model.parameters() order; `trainable_numels`: the optimizer's (None: all);
    `trainable_params_bytes` in the answer: what of `params_bytes` the optimizer updates. `client_optimizer`:
    ResolvedRun.client_optimizer; `trainable_shapes`: for stage 0 (Adafactor factors by shape);
    `trainable_groups`: parameters per optimizer group (ModelStats.trainable_groups; None: one group)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    numels, train = numels_of(param_numels, trainable_numels)
    if not use_deepspeed:
        return stage0.states(numels, train, ds_config, world_size, _PLAIN, None, plain=True, client=client_optimizer,
                             shapes=trainable_shapes, groups=trainable_groups)
    zero = zero_config(ds_config)
    return rules_for(int(zero.stage)).states(numels, train, ds_config, world_size, precision_of(ds_config), zero,
                                             client=client_optimizer, shapes=trainable_shapes, groups=trainable_groups)


def param_numels(model_cfg: Model, adapter_cfg: Adapter | None = None) -> tuple[list[int], list[int]]:
    """Every parameter's size and the trainable ones' (adapter_cfg: the run's `adapter`), in
    model.parameters() order, from a meta-device build."""
    from zerotune.models import model_stats

    stats = model_stats(model_cfg, adapter_cfg)
    return numels_of(stats.param_numels, stats.trainable_numels or None)


def buffer_terms(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                 rank: int | None = None, use_deepspeed: bool = True,
                 trainable_numels: list[int] | None = None, groups: list[int] | None = None,
                 device: str = "cuda") -> list[Term]:
    """Every buffer of this configuration, named, with its source; `rank` None: the largest over ranks. Plain
    accelerate's are stage0.plain_buffers' (DDP's, gradients kept across micro-steps), on `device`."""
    if not use_deepspeed:
        return stage0.plain_buffers(ds_config, numels_of(param_numels, trainable_numels)[1], world_size, device)
    prec, zero = precision_of(ds_config), zero_config(ds_config)
    if precision is not None and precision != prec.name:
        raise ValueError(f"precision {precision!r} disagrees with the DeepSpeed dict's {prec.name!r}")
    numels, train = numels_of(param_numels, trainable_numels)
    return rules_for(int(zero.stage)).buffers(ds_config, numels, train, world_size, rank, prec, zero, groups)


def _placed(where: str, ds_config: dict, param_numels: list[int], world_size: int, precision: str | None,
            rank: int | None, use_deepspeed: bool, trainable_numels: list[int] | None,
            groups: list[int] | None = None, device: str = "cuda") -> tuple[dict, list[Term], int]:
    """({name: bytes} of the buffers in `where` overlapping no model state, those sharing the gradients', grads)."""
    terms = [t for t in buffer_terms(ds_config, param_numels, world_size, precision, rank, use_deepspeed,
                                     trainable_numels, groups, device) if t.where == where]
    wider = [t for t in terms if t.overlaps == "grads_bytes"]
    grads = model_state_bytes(param_numels, ds_config, world_size, rank or 0, use_deepspeed,
                              trainable_numels, trainable_groups=groups)["grads_bytes"] if wider else 0
    return {t.term: t.nbytes for t in terms if not t.overlaps}, wider, grads


def gpu_buffer_bytes(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                     rank: int | None = None, use_deepspeed: bool = True,
                     trainable_numels: list[int] | None = None, groups: list[int] | None = None,
                     device: str = "cuda") -> dict:
    """{name: bytes} of the GPU buffers a planner adds to the model states (overlapping terms left out;
    the stage-2 contiguous-gradients buffer counts only what it holds beyond the gradient partition)."""
    out, wider, grads = _placed("gpu", ds_config, param_numels, world_size, precision, rank, use_deepspeed,
                                trainable_numels, groups, device)
    return {**out, **{t.term: max(0, t.nbytes - grads) for t in wider}}


def host_buffer_bytes(ds_config: dict, param_numels: list[int], world_size: int, precision: str | None = None,
                      rank: int | None = None, use_deepspeed: bool = True,
                      trainable_numels: list[int] | None = None, groups: list[int] | None = None,
                      device: str = "cuda") -> dict:
    """{name: bytes} of DeepSpeed's pinned host buffers beyond the model states (offload staging, swap)."""
    out, wider, grads = _placed("host", ds_config, param_numels, world_size, precision, rank, use_deepspeed,
                                trainable_numels, groups, device)
    # ZeRO-2 offload holds the gradient partition in fp32, wider than the parameters' dtype: the excess counts
    return {**out, **{t.term + "_beyond_grads": t.nbytes - grads for t in wider if t.nbytes > grads}}

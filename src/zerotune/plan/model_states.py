"""Per-rank bytes of the model states (parameters, gradients, fp32 master weights, optimizer states) a run
will hold, predicted from the parameter sizes and the validated DeepSpeed dict, with no weights built.

The keys are the ones `training/partition.py::partition_bytes` reads from the live engine after step 1. The
rules are DeepSpeed 0.19.8's own, padding included, each with the rest of its stage's rules (stage0.py,
zero12.py, zero3.py); DeepSpeed's own buffers on top of these are buffers.py's.
"""

from __future__ import annotations

from zerotune.plan import stage0
from zerotune.plan.rules import Precision, numels_of, precision_of, zero_config
from zerotune.plan.stages import rules_for
from zerotune.schema import Adapter, Model

# Plain accelerate keeps fp32 weights (autocast for bf16/fp16) and builds torch's optimizer on them.
_PLAIN = Precision("fp32", 4, 4, 4, False)


def model_state_bytes(param_numels: list[int], ds_config: dict, world_size: int, rank: int,
                      use_deepspeed: bool, trainable_numels: list[int] | None = None,
                      client_optimizer: dict | None = None,
                      trainable_shapes: list[tuple[int, ...]] | None = None,
                      trainable_groups: list[int] | None = None) -> dict:
    """This rank's bytes of parameters, gradients, master weights and optimizer states, as
    `partition_bytes` will read them after step 1, with where each lives (`where`: gpu | host) and the
    element sizes. `param_numels`: every parameter's size in model.parameters() order; `trainable_numels`:
    the optimizer's (same order; None: all). `trainable_params_bytes`: what of `params_bytes` the
    optimizer updates (whole at stages 0-2, this rank's partitions at stage 3). `client_optimizer`: the one
    zerotune hands the engine (ResolvedRun.client_optimizer); `trainable_shapes`: the trained parameters'
    shapes, where the optimizer steps them whole (stage 0: Adafactor factors by shape); `trainable_groups`: how many of
    them each optimizer parameter group holds (ModelStats.trainable_groups; None: one group)."""
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

"""Per-rank bytes of the model states (parameters, gradients, fp32 master weights, optimizer states) a run
will hold, predicted from the parameter sizes and the validated DeepSpeed dict, with no weights built.

The keys are the ones `training/partition.py::partition_bytes` reads from the live engine after step 1,
and the rules are DeepSpeed 0.19.8's own (runtime/zero/stage_1_and_2.py, stage3.py,
partition_parameters.py, parameter_offload.py), padding included:

- stages 1-2: the optimizer's (trainable) parameters form one flat group padded to a multiple of
  nccl_start_alignment_factor (2) x world size; each rank owns `flat // world` elements of it
  (master weights, optimizer states and, at stage 2, gradients). Frozen parameters (an adapter's base
  U-Net) are no part of it: ordinary module parameters, whole on every rank, in the engine's dtype.
- stage 3: each module parameter, frozen ones included, is padded to a multiple of the world size and
  split evenly (`ds_tensor`); parameters of at most `stage3_param_persistence_threshold` elements are also
  kept whole. Gradients of the trainable ones live in one flat buffer of their partitions; master weights
  and optimizer states per sub-group of the trainable partitions.
- stage 0 / plain accelerate: nothing is partitioned; gradients and optimizer of the trainable ones.

Every function takes `param_numels` (all of `unet.parameters()`, in order) and `trainable_numels` (those
the optimizer gets, in the same order; None: all of them, as without an adapter).

Each stage's rule lives with the rest of that stage's rules (stage0.py, zero12.py, zero3.py); DeepSpeed's own
buffers on top of these are buffers.py's.
"""

from __future__ import annotations

from zerotune.plan import stage0
from zerotune.plan.rules import precision_of, trainable_or_all, zero_config
from zerotune.plan.stages import rules_for
from zerotune.schema import Adapter, Model


def model_state_bytes(param_numels: list[int], ds_config: dict, world_size: int, rank: int,
                      use_deepspeed: bool, trainable_numels: list[int] | None = None) -> dict:
    """This rank's bytes of parameters, gradients, master weights and optimizer states, as
    `partition_bytes` will read them after step 1, with where each lives (`where`: gpu | host) and the
    element sizes. `param_numels`: every parameter's size in model.parameters() order; `trainable_numels`:
    the optimizer's (same order; None: all). `trainable_params_bytes`: what of `params_bytes` the
    optimizer updates (whole at stages 0-2, this rank's partitions at stage 3)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    numels, train = [int(n) for n in param_numels], trainable_or_all(param_numels, trainable_numels)
    if not use_deepspeed:
        return stage0.plain_states(numels, train, ds_config, world_size, rank)
    zero = zero_config(ds_config)
    return rules_for(int(zero.stage)).states(numels, train, ds_config, world_size, rank, precision_of(ds_config), zero)


def param_numels(model_cfg: Model, adapter_cfg: Adapter | None = None) -> tuple[list[int], list[int]]:
    """Every parameter's size and the trainable ones' (adapter_cfg: the run's `adapter`), in
    model.parameters() order, from a meta-device build."""
    from zerotune.models import model_stats

    stats = model_stats(model_cfg, adapter_cfg)
    return list(stats.param_numels), list(stats.trainable_numels or stats.param_numels)

"""zerotune.plan.model_states: per-rank model-state bytes predicted without weights, checked by hand on small
cases and against what the real DeepSpeed engine holds after step 1 (`partition_bytes`, ranks/rank<k>.json).

The end-to-end grid (2 models x stages 0-3 x offload none/cpu x world 1/2 x adapter none/lora) is slow:
representative pairs (full training; LoRA with its frozen base) run in the fast suite, the rest under
`-m slow`. ZEROTUNE_ENGINE_TREE=/path/to/checkout runs the
engine side from another checkout (benchmarks/bench_plan_model_states.py --tree), e.g. while the working
tree's CLI is mid-edit.
"""

from __future__ import annotations

import os
from itertools import product
from pathlib import Path

import pytest

from benchmarks.bench_plan_model_states import KEYS, compare, engine_partitions, refused
from tests.helpers.cli import ROOT, config_of
from zerotune.models import _from_config, model_stats
from zerotune.plan.model_states import Partitioning, param_numels
from zerotune.plan.zero3_runtime import stage3_partition_numel, stage3_sub_groups
from zerotune.plan.zero12 import zero12_flat

ODD = [3, 5, 7]  # 15 elements: padded to 16 at world 2 (stages 1-2), to 2+3+4 per rank at stage 3
TREE = Path(os.environ.get("ZEROTUNE_ENGINE_TREE", ROOT))


def ds(stage: int, offload: str = "none", precision: str = "fp32", optimizer: str = "AdamW", **zero) -> dict:
    params = {"lr": 1e-3, **({"torch_adam": True} if optimizer == "AdamW" and offload == "none" else {})}
    block = {"stage": stage, **zero}
    if offload != "none":
        block["offload_optimizer"] = {"device": offload}
    out = {"zero_optimization": block, "optimizer": {"type": optimizer, "params": params}}
    if precision != "fp32":
        out[precision] = {"enabled": True}
    return out


def states(numels, config, world=2, use_deepspeed=True, trainable=None) -> tuple[int, int, int, int]:
    got = Partitioning(numels, config, world, use_deepspeed, trainable).states
    return tuple(got[k] for k in KEYS)


# ------------------------------------------------------------------------------------------- by hand


def test_stage1_and_2_pad_the_flat_group_to_twice_the_world():
    assert zero12_flat(ODD, 2, False, 4) == 16 and zero12_flat(ODD, 1, False, 4) == 16
    assert zero12_flat([3, 5, 6], 2, False, 4) == 16 and zero12_flat([3, 5, 9], 2, False, 4) == 20
    # stage 1: whole params and grads; an 8-element share of master weights, 2 moments + torch's 4-byte step
    assert states(ODD, ds(1)) == (60, 60, 32, 2 * 32 + 4)
    assert states(ODD, ds(2)) == (60, 32, 32, 68)  # stage 2: the gradients' share too
    assert states(ODD, ds(2), world=1) == (60, 64, 64, 2 * 64 + 4)


def test_parameter_alignment_pads_each_tensor_but_the_last():
    # fp32: 16 // gcd(16, 4) = 4-element alignment: 3 -> 4, 5 -> 8, 7 stays; 19 -> 20 for world 2
    assert zero12_flat(ODD, 2, True, 4) == 20
    assert states(ODD, ds(2, parameter_alignment=True))[2] == 40


def test_stage3_pads_every_tensor_and_keeps_small_ones_whole():
    assert [stage3_partition_numel(n, 2) for n in ODD] == [2, 3, 4]
    assert stage3_partition_numel(7, 3) == 3 and stage3_partition_numel(6, 3) == 2
    # the 3-element tensor is under the threshold: its 2-element partition and its whole 3 elements
    config = ds(3, stage3_param_persistence_threshold=4)
    assert states(ODD, config) == ((9 + 3) * 4, 9 * 4, 9 * 4, 2 * 9 * 4 + 4)
    got = Partitioning(ODD, config, 2).states
    assert got["params_persistent_bytes"] == 12 and got["master_weights_alias_params"]  # fp32, no offload


def test_stage3_sub_groups_each_keep_a_step():
    assert stage3_sub_groups([2, 3, 4], 4) == [5, 4] and stage3_sub_groups([2, 3, 4], 10**9) == [9]
    config = ds(3, stage3_param_persistence_threshold=0, sub_group_size=4)
    assert states(ODD, config)[3] == 2 * 9 * 4 + 2 * 4


def test_offload_moves_master_weights_and_states_to_the_host():
    got = Partitioning(ODD, ds(2, "cpu"), 2).states
    assert (got["optimizer"], got["optimizer_state_bytes"]) == ("DeepSpeedCPUAdam", 64)  # int step, no tensor
    assert got["where"] == {"params": "gpu", "grads": "host", "master_weights": "host", "optimizer_state": "host"}
    got3 = Partitioning(ODD, {**ds(3, "cpu"), "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}, 2).states
    assert got3["where"]["params"] == "host" and not got3["master_weights_alias_params"]


def test_precision_sets_the_element_sizes():
    # bf16 stage 2 with FusedAdam: 2-byte params and gradient share, fp32 master and moments
    assert states(ODD, {**ds(2, precision="bf16"), "optimizer": {"type": "AdamW", "params": {}}}) == (30, 16, 32, 64)
    # stage 0 in bf16: torch's AdamW behind FP16_UnfusedOptimizer, an fp32 copy per tensor
    assert states(ODD, ds(0, precision="bf16")) == (30, 30, 60, 2 * 60 + 3 * 4)
    accum = {**ds(3, precision="bf16"), "data_types": {"grad_accum_dtype": "fp32"}}
    assert Partitioning(ODD, accum, 2).states["grads_bytes"] == 9 * 4


def test_stage0_and_plain_partition_nothing():
    assert states(ODD, ds(0)) == (60, 60, 0, 2 * 60 + 3 * 4)
    assert states(ODD, ds(0), use_deepspeed=False) == (60, 60, 0, 132)
    plain_adagrad = {"optimizer": {"type": "Adagrad", "params": {"lr": 0.01}}}
    assert states(ODD, plain_adagrad, use_deepspeed=False)[3] == 60 + 3 * 4


def test_other_optimizers_state_counts():
    # CPU Lion allocates exp_avg_sq next to exp_avg (unused): two fp32 states; Adagrad keeps one
    assert states(ODD, ds(2, "cpu", optimizer="Lion"))[3] == 2 * 32
    assert states(ODD, ds(2, "cpu", optimizer="Adagrad"))[3] == 32
    assert states(ODD, ds(2, optimizer="Adagrad"))[3] == 32 + 4  # torch's Adagrad, rebuilt on the partition
    with pytest.raises(ValueError, match="rank 2"):
        Partitioning(ODD, ds(2), 2).buffers(rank=2)


def test_buffers_name_their_source_and_overlaps():
    terms = {t.term: t for t in Partitioning([3, 6, 7], ds(2, reduce_bucket_size=100, overlap_comm=True), 2).buffers()}
    assert terms["ipg_bucket"].nbytes == 2 * 100 * 4 and "setup_buckets" in terms["ipg_bucket"].note
    assert terms["flat_group_padding"].nbytes == 0
    # partition 8: rank 0 holds params 0-1 (9 elements), rank 1 params 1-2 (13): whole tensors
    assert terms["contiguous_gradients"].nbytes == 13 * 4 and terms["contiguous_gradients"].overlaps
    gpu = Partitioning([3, 6, 7], ds(2, reduce_bucket_size=100, overlap_comm=True), 2, precision="fp32").gpu_buffer_bytes(rank=0)
    assert gpu["contiguous_gradients"] == 4
    host = Partitioning(ODD, ds(1, "cpu", reduce_bucket_size=100), 2).host_buffer_bytes()
    # each pinned buffer also holds its block beyond its bytes: torch's pinned allocator rounds to a power of 2
    assert host == {"offload_fp32_grad_partition": 32, "offload_bit16_param_partition": 32, "offload_temp_grad_host": 28,
                    "offload_fp32_master_pinned_rounding": 0, "offload_fp32_grad_partition_pinned_rounding": 0,
                    "offload_bit16_param_partition_pinned_rounding": 0, "offload_temp_grad_host_pinned_rounding": 4}
    offload_gpu = Partitioning(ODD, ds(2, "cpu", reduce_bucket_size=100), 2).gpu_buffer_bytes()
    # the largest parameter (7 elements) in the model dtype for staging, and cast to fp64 for its norm
    assert offload_gpu["offload_temp_grad_gpu"] == 7 * 4 and offload_gpu["offload_grad_norm_fp64"] == 7 * 8
    assert "offload_grad_norm_fp64" not in Partitioning(ODD, ds(2, reduce_bucket_size=100), 2).gpu_buffer_bytes()
    z3 = {t.term: t for t in Partitioning(ODD, ds(3, reduce_bucket_size=100, stage3_max_live_parameters=10,
                                                   stage3_param_persistence_threshold=0), 2).buffers()}
    assert z3["ipg_bucket"].nbytes == 400 and z3["stage3_live_params"].nbytes == 10 * 4
    # gathered tensors are padded: 2 + 3 + 4 partitions x 2 ranks = 18 elements, under the 50M prefetch
    assert z3["stage3_prefetch_bucket"].nbytes == 18 * 4 and z3["stage3_prefetch_bucket"].overlaps
    assert all(t.note.startswith("runtime/") for t in z3.values())
    assert Partitioning(ODD, ds(0), 2).buffers()[0].nbytes == 15 * 4  # stage 0: one flat copy of the gradients
    # plain accelerate: none of DeepSpeed's; with two processes DDP's buckets, a copy of the gradients (fp32)
    assert Partitioning(ODD, ds(0), 2, use_deepspeed=False).gpu_buffer_bytes() == {"ddp_gradient_buckets": 15 * 4}
    assert Partitioning(ODD, ds(0), 1, use_deepspeed=False).gpu_buffer_bytes() == {}
    with pytest.raises(ValueError, match="disagrees"):
        Partitioning(ODD, ds(2), 2, precision="bf16")


# ------------------------------------------------------------------------------------------- with an adapter

MIXED, TRAINED = [3, 5, 7, 4], [5, 4]  # 19 elements, of which the 5 and the 4 train (an adapter's); 10 frozen


def test_zero12_flatten_only_the_trained_parameters():
    # the frozen 3 and 7 stay whole module parameters: params count all 19 elements, in the model dtype
    assert states(MIXED, ds(2), trainable=TRAINED) == (76, 6 * 4, 6 * 4, 2 * 6 * 4 + 4)  # flat 9 -> 12: 6 a rank
    assert states(MIXED, ds(1), trainable=TRAINED) == (76, 9 * 4, 6 * 4, 2 * 6 * 4 + 4)  # whole trained grads
    bf16 = {**ds(1, precision="bf16"), "data_types": {"grad_accum_dtype": "fp32"}}  # BF16_Optimizer
    assert states(MIXED, bf16, trainable=TRAINED)[:2] == (38, 12 * 4)
    got = Partitioning(MIXED, ds(2), 2, trainable_numels=TRAINED).states
    assert got["partition_numel"] == 6 and got["trainable_params_bytes"] == 9 * 4


def test_stage3_partitions_frozen_parameters_without_their_states():
    config = ds(3, stage3_param_persistence_threshold=3)  # the frozen 3 also stays whole
    # every parameter's partition (2+3+4+2) and the whole 3; gradients, master, states: the trained 3+2
    assert states(MIXED, config, trainable=TRAINED) == ((11 + 3) * 4, 5 * 4, 5 * 4, 2 * 5 * 4 + 4)
    assert Partitioning(MIXED, config, 2, trainable_numels=TRAINED).states["params_persistent_bytes"] == 12


def test_stage0_and_plain_keep_gradients_and_states_of_the_trained_only():
    assert states(MIXED, ds(0), trainable=TRAINED) == (76, 36, 0, 2 * 36 + 2 * 4)
    assert states(MIXED, ds(0), use_deepspeed=False, trainable=TRAINED) == (76, 36, 0, 2 * 36 + 2 * 4)
    assert states(MIXED, ds(0, precision="bf16"), trainable=TRAINED) == (38, 18, 36, 2 * 36 + 2 * 4)


def test_buffers_follow_the_optimizers_parameters():
    offload = Partitioning(MIXED, ds(2, "cpu", reduce_bucket_size=100), 2, trainable_numels=TRAINED).gpu_buffer_bytes()
    # the largest trained parameter (5), not the frozen 7, sizes the staging and norm buffers
    assert offload["offload_temp_grad_gpu"] == 5 * 4 and offload["offload_grad_norm_fp64"] == 5 * 8
    host = Partitioning(MIXED, ds(1, "cpu", reduce_bucket_size=100), 2, trainable_numels=TRAINED).host_buffer_bytes()
    assert host == {"offload_fp32_grad_partition": 24, "offload_bit16_param_partition": 24,
                    "offload_temp_grad_host": 20, "offload_fp32_master_pinned_rounding": 8,
                    "offload_fp32_grad_partition_pinned_rounding": 8,
                    "offload_bit16_param_partition_pinned_rounding": 8, "offload_temp_grad_host_pinned_rounding": 12}
    assert Partitioning(MIXED, ds(0), 2, trainable_numels=TRAINED).buffers()[0].nbytes == 9 * 4
    z3 = {t.term: t for t in Partitioning(MIXED, ds(3, "cpu", reduce_bucket_size=100,
                                                     stage3_param_persistence_threshold=0), 2,
                                          trainable_numels=TRAINED).buffers()}
    # forward and backward gather every parameter, frozen ones too: (2+3+4+2) x 2 ranks
    assert z3["stage3_prefetch_bucket"].nbytes == 22 * 4
    assert z3["offload_fp32_grad_partition"].nbytes == 5 * 4  # the trained partitions only


def test_the_meta_build_counts_the_adapter():
    from accelerate import init_empty_weights

    cfg = config_of("model=sdxl_tiny", "adapter=lora", "adapter.rank=4")
    numels, trained = param_numels(cfg.model, cfg.adapter)
    stats = model_stats(cfg.model)
    assert sum(numels) == stats.num_params + sum(trained) and list(stats.param_numels) == param_numels(cfg.model)[0]
    # LoRA on each targeted linear layer: an (r x in) A and an (out x r) B
    with init_empty_weights():
        base = _from_config(cfg.model)
    targets = tuple(str(t) for t in cfg.adapter.target_modules)
    layers = [m for name, m in base.named_modules() if name.endswith(targets)]
    assert layers and sum(trained) == sum(4 * (m.in_features + m.out_features) for m in layers)
    assert len(trained) == 2 * len(layers)


# ------------------------------------------------------------------------------------------- vs the engine


def _check(combo, engine) -> None:
    bad = [r for r in compare(combo, engine) if r["diff"]]
    assert not bad, bad


@pytest.mark.parametrize("combo", [pytest.param(("tiny", 2, "cpu", 2), marks=pytest.mark.slow), ("sdxl_tiny", 3, "none", 2)])
def test_prediction_equals_the_engine(combo, tmp_path):
    _check(combo, engine_partitions([combo], tmp_path, TREE)[combo])


# LoRA: ZeRO-2 flattens only the adapter, ZeRO-3 partitions the frozen base too; offload stages the adapter's.
LORA = [("sdxl_tiny", 2, "cpu", 2, "lora"), ("sdxl_tiny", 3, "cpu", 2, "lora")]


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory) -> dict:
    return engine_partitions(LORA, tmp_path_factory.mktemp("lora"), TREE)  # one -m sweep of the two


@pytest.mark.slow  # one -m sweep of real engines, 38 s; the meta build's LoRA count is checked by default
@pytest.mark.parametrize("combo", LORA, ids=lambda c: "-".join(map(str, c)))
def test_prediction_equals_the_engine_with_lora(combo, lora_engine):
    _check(combo, lora_engine[combo])


GRID = [c for c in product(("tiny", "sdxl_tiny"), (0, 1, 2, 3), ("none", "cpu"), (1, 2), ("none", "lora"))
        if not refused(*c)]


@pytest.fixture(scope="module")
def grid_engine(tmp_path_factory) -> dict:
    return engine_partitions(GRID, tmp_path_factory.mktemp("grid"), TREE)  # two -m sweeps for all 56


@pytest.mark.slow
@pytest.mark.parametrize("combo", GRID, ids=lambda c: "-".join(map(str, c)))
def test_prediction_equals_the_engine_on_the_grid(combo, grid_engine):
    _check(combo, grid_engine[combo])

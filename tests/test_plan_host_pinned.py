"""The host terms of CPU offload at the sizes torch's pinned allocator gives them (plan/host_memory.py), per parameter
group; the heap glibc keeps of a module's host copies (host.py heap_kept_bytes); and a card's host figure as the
process RSS the run measures (process.py card_process_prediction)."""

from __future__ import annotations

import pytest

from zerotune.config.schema import MIB
from zerotune.plan import host_memory as process
from zerotune.plan.host_memory import (
    HEAP_KEPT,
    MMAP_THRESHOLD_MAX,
    PINNED_CACHE,
    PINNED_ROUNDING,
    cuda_only,
    heap_kept_bytes,
    pinned_block_bytes,
    rank_terms,
    rounding_bytes,
)
from zerotune.plan.model_states import Partitioning
from zerotune.plan.rules import split_groups
from zerotune.plan.zero12 import zero12_flat
from zerotune.rundir.plan import Plan, Term

# ------------------------------------------------------------------------------------------- the rounding rule


def test_a_pinned_block_is_the_next_power_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4, 5, 28, 32, 33, 4095, 4096, 4097)] == \
        [0, 1, 2, 4, 4, 8, 32, 32, 64, 4096, 4096, 8192]
    # SDXL's U-Net, one rank: its fp32 partition (9,794 MiB), its bf16 one (4,897 MiB), its largest parameter
    numel = 2_567_463_684
    assert pinned_block_bytes(numel * 4) == 16384 * MIB and pinned_block_bytes(numel * 2) == 8192 * MIB
    assert pinned_block_bytes(29_491_200 * 2) == 64 * MIB
    assert rounding_bytes([3, 4, 5]) == 1 + 0 + 3


def test_the_heap_keeps_the_copies_under_the_mmap_ceiling():
    assert MMAP_THRESHOLD_MAX == 32 * MIB
    assert heap_kept_bytes([0, 100, 32 * MIB - 1, 32 * MIB, 64 * MIB]) == 100 + 32 * MIB - 1


# ------------------------------------------------------------------------------------------- ZeRO-1/2 offload

NUMELS = [3, 5, 6, 10]  # 24 elements; world 1 pads each group's flat buffer to a multiple of 2


def ds(stage: int, pin: bool | None = True, precision: str = "bf16", **extra) -> dict:
    block: dict = {"device": "cpu"} if pin is None else {"device": "cpu", "pin_memory": pin}
    zero = {"stage": stage, "offload_optimizer": block, "reduce_bucket_size": 100}
    if stage == 3:
        zero.update(offload_param=dict(block), stage3_param_persistence_threshold=0, sub_group_size=12)
    out = {"zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
    if precision != "fp32":
        out[precision] = {"enabled": True}
    return out


def host_terms(config: dict, groups: list[int] | None = None, numels: list[int] = NUMELS, world: int = 1,
               trainable: list[int] | None = None) -> dict[str, int]:
    return {t.term: t.nbytes for t in Partitioning(numels, config, world, True, trainable, groups).buffers(0)
            if t.where == "host"}


def expected_rounding(groups: list[int] | None, elem: int, world: int = 1) -> int:
    """Each group's partition of its flat buffer, pinned on its own."""
    parts = [zero12_flat(g, world, False, 2) // world for g in split_groups(NUMELS, groups)]
    return sum(pinned_block_bytes(p * elem) - p * elem for p in parts)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_offload_rounds_each_groups_pinned_buffers(stage):
    one = host_terms(ds(stage))
    # one group of 24: fp32 master and gradient partitions 96 B -> 128, the bf16 buffer 48 -> 64, the largest
    # parameter's staging buffer 10 x 2 = 20 -> 32
    assert one["offload_fp32_master" + PINNED_ROUNDING] == 32 == expected_rounding(None, 4)
    assert one["offload_fp32_grad_partition" + PINNED_ROUNDING] == 32
    assert one["offload_bit16_param_partition" + PINNED_ROUNDING] == 16 == expected_rounding(None, 2)
    assert one["offload_temp_grad_host" + PINNED_ROUNDING] == 12
    # two groups of 8 and 16 elements: powers of two already, nothing rounded
    two = host_terms(ds(stage), [2, 2])
    assert two["offload_fp32_master" + PINNED_ROUNDING] == 0 == expected_rounding([2, 2], 4)
    assert two["offload_bit16_param_partition" + PINNED_ROUNDING] == 0
    # 4 (3 padded) and 22 (21 padded): 16 -> 16 and 88 -> 128 in fp32, each group on its own
    uneven = host_terms(ds(stage), [1, 3])
    assert uneven["offload_fp32_master" + PINNED_ROUNDING] == 40 == expected_rounding([1, 3], 4)
    assert uneven["offload_fp32_grad_partition" + PINNED_ROUNDING] == 40
    assert uneven["offload_bit16_param_partition" + PINNED_ROUNDING] == 20 == expected_rounding([1, 3], 2)
    # the tensors themselves stay their padded sizes (24, then 4 + 22 elements), and world 2 rounds each rank's half
    assert (one["offload_bit16_param_partition"], uneven["offload_bit16_param_partition"]) == (48, 52)
    assert host_terms(ds(stage), [1, 3], world=2)["offload_fp32_master" + PINNED_ROUNDING] == \
        expected_rounding([1, 3], 4, world=2)


def test_unpinned_or_natively_pinned_buffers_are_their_tensors(monkeypatch):
    assert host_terms(ds(2, pin=None)) == host_terms(ds(2))  # DeepSpeed's default (offload_config.py): pinned
    assert not any(name.endswith(PINNED_ROUNDING) for name in host_terms(ds(2, pin=False)))
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")  # mlock'd at the exact size (utils/pin_memory.py)
    assert not any(name.endswith(PINNED_ROUNDING) for name in host_terms(ds(2)))


def test_gradient_accumulation_keeps_a_pinned_host_gradient_per_parameter():
    terms = host_terms(ds(2, gradient_accumulation_steps=4))
    assert terms["offload_accumulated_grads_host"] == 24 * 2  # every parameter touches the one rank's partition
    assert terms["offload_accumulated_grads_host" + PINNED_ROUNDING] == rounding_bytes([6, 10, 12, 20])
    assert "offload_accumulated_grads_host" not in host_terms(ds(2))
    # fp32 accumulation of bf16 parameters takes the compact partition on the card instead
    compact = ds(2, gradient_accumulation_steps=4, data_types={"grad_accum_dtype": "fp32"})
    assert "offload_accumulated_grads_host" not in host_terms(compact)


def test_the_engines_cast_leaves_its_copies_in_the_heap_below_zero3():
    big = [8 * MIB, 16 * MIB]  # bf16 copies of 16 MiB and 32 MiB: the first from the heap, the second mmapped
    for stage in (1, 2):
        assert host_terms(ds(stage), numels=big)[HEAP_KEPT] == 16 * MIB
        assert Partitioning(big, ds(stage, pin=False), 1).host_buffer_bytes()[HEAP_KEPT] == 16 * MIB
    assert HEAP_KEPT not in host_terms(ds(2, precision="fp32"))  # no cast: the fp32 build is mmapped, then unmapped
    assert HEAP_KEPT not in host_terms(ds(3))  # zero.Init builds on the card


@pytest.mark.parametrize("groups", [1, 3])
def test_a_zero2_cpu_offload_plans_host_terms_hold_each_groups_pinned_blocks(groups):
    from tests.helpers.cli import preflight
    from zerotune.config.compose import compose
    from zerotune.plan import gpus
    from zerotune.plan.command_line import plan_one, platform_for

    overrides = ["model=sdxl_tiny", "resolution=32", "train.batch_size=2", "zero_stage=2", "offload=cpu",
                 "precision=bf16", f"deepspeed.param_groups={groups}"]
    plan = plan_one(overrides, gpus.lookup("h100"))
    checked = preflight(compose(overrides), overrides=overrides, platform=platform_for(gpus.lookup("h100")))
    stats = checked.model_stats
    cut = split_groups(list(stats.trainable_numels or stats.param_numels), checked.group_sizes())
    assert len(cut) == groups
    parts = [zero12_flat(g, 1, False, 2) for g in cut]  # one rank: each group's partition is its flat buffer
    held = {t.term: t.mib * MIB for t in plan.host_terms}
    for name, elem in (("offload_fp32_master", 4), ("offload_fp32_grad_partition", 4),
                       ("offload_bit16_param_partition", 2)):
        blocks = sum(pinned_block_bytes(p * elem) for p in parts)  # each group's tensor pinned on its own
        assert held[f"deepspeed:{name}{PINNED_ROUNDING}"] == pytest.approx(blocks - sum(parts) * elem)
    # with the tensors' own terms, the host holds the blocks: the fp32 master and gradient partitions, the bf16 buffer
    assert held["master_weights"] + held["deepspeed:offload_fp32_master" + PINNED_ROUNDING] == \
        pytest.approx(sum(pinned_block_bytes(p * 4) for p in parts))
    assert held["grads"] + held["deepspeed:offload_fp32_grad_partition_beyond_grads"] + \
        held["deepspeed:offload_fp32_grad_partition" + PINNED_ROUNDING] == \
        pytest.approx(sum(pinned_block_bytes(p * 4) for p in parts))
    # the host figure is the worker's RSS: its process baseline beside the larger of its terms and its fp32 build
    process = {t.term: (t.mib or 0.0) * MIB for t in plan.host_process_terms.terms}
    terms = sum(v for k, v in held.items() if k != "model_load")
    assert process["rank_tensors"] == pytest.approx(max(terms, held["model_load"]), rel=1e-6)
    assert plan.host_peak_mib * MIB == pytest.approx(process["process_baseline"] + process["rank_tensors"], rel=1e-6)


# ------------------------------------------------------------------------------------------- ZeRO-3 offload


def test_zero3_offload_rounds_its_pinned_buffers_and_keeps_zero_inits():
    # world 1, sub_group_size 12: sub-groups of 14 (3+5+6) and 10 elements; all four parameters trained
    terms = host_terms(ds(3))
    assert terms["offload_fp32_grad_partition" + PINNED_ROUNDING] == rounding_bytes([14 * 4, 10 * 4])
    assert terms["offload_grad_partitions_flat" + PINNED_ROUNDING] == rounding_bytes([24 * 2])
    assert terms["offload_param_flat" + PINNED_ROUNDING] == rounding_bytes([24 * 2])
    # zero.Init pinned each partition alone; moved into the flat buffer, their whole blocks stay cached
    assert terms["zero_init_param_partitions" + PINNED_CACHE] == sum(pinned_block_bytes(n * 2) for n in NUMELS)
    # per parameter group: two groups, two flat buffers of 16 and 32 bytes
    assert host_terms(ds(3), [2, 2])["offload_param_flat" + PINNED_ROUNDING] == 0
    # a frozen parameter (the 10) keeps its partition: only its block's rounding is extra
    frozen = host_terms(ds(3), trainable=[3, 5, 6])
    assert frozen["zero_init_param_partitions" + PINNED_CACHE] == \
        sum(pinned_block_bytes(n * 2) for n in (3, 5, 6)) + rounding_bytes([20])
    assert not any(name.endswith((PINNED_ROUNDING, PINNED_CACHE)) for name in host_terms(ds(3, pin=False)))


# ------------------------------------------------------------------------------------------- where they count


def terms(*pairs: tuple[str, float], moment: str | None = None) -> list[Term]:
    return [Term(name, mib, "", moment) for name, mib in pairs]


CARD_HOST = terms(("master_weights", 100.0), ("deepspeed:offload_fp32_master" + PINNED_ROUNDING, 28.0),
                  ("deepspeed:" + HEAP_KEPT, 7.0), ("model_load", 120.0))


def test_the_terms_only_a_card_has_leave_a_cpu_accelerators_host():
    assert cuda_only("deepspeed:offload_fp32_master" + PINNED_ROUNDING) and cuda_only("deepspeed:" + HEAP_KEPT)
    assert cuda_only("zero_init_param_partitions" + PINNED_CACHE) and not cuda_only("deepspeed:offload_temp_grad_host")
    plan = Plan.made(device="cuda", gpu_terms=terms(("cuda_context", 400.0), ("params", 10.0)), host_terms=CARD_HOST)
    assert rank_terms(plan, "cuda") == {"master_weights": 100.0, "deepspeed:offload_fp32_master" + PINNED_ROUNDING: 28.0,
                                        "deepspeed:" + HEAP_KEPT: 7.0}
    assert rank_terms(plan, "cpu") == {"params": 10.0, "master_weights": 100.0}
    # a CPU plan's step peak holds them too (predict.py pools the host terms): the process figure leaves them out
    cpu = Plan.made(device="cpu", step_peak_mib=135.0, step_peak_moment="persistent", step_terms=CARD_HOST[:3],
                    host_terms=terms(("model_load", 20.0)))
    assert process.rank_tensors_mib(cpu)[0] == 100.0


def test_a_cards_host_figure_is_the_process_rss_of_its_ranks(monkeypatch):
    monkeypatch.setattr(process, "process_baseline_mib", lambda on_card=False: None if on_card else 500.0)
    plan = Plan.made(device="cuda", host_peak_mib=135.0, host_terms=CARD_HOST)
    marked = process.card_process_prediction(plan, 2)
    assert marked.host_peak_kind == process.PROCESS_RSS
    assert marked.host_peak_mib == 2 * (500.0 + 135.0)  # the step's host terms, above the 120 MiB fp32 build
    assert plan.host_peak_mib == 135.0 and "host_peak_kind" not in plan  # a new plan: the one given is as it was
    loading = process.card_process_prediction(plan.adding(host_terms=terms(("model_load", 900.0))), 1)
    assert loading.host_peak_mib == 500.0 + 900.0
    monkeypatch.setattr(process, "process_baseline_mib", lambda on_card=False: None)  # unmeasured: the figure stays
    assert process.card_process_prediction(plan, 1).host_peak_mib == 135.0

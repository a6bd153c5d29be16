"""ZeRO-3 on a card: the caching-allocator simulator (plan/allocator.py) on hand-checked sequences, the replay's
terms against what DeepSpeed 0.19.8's and torch's own code allocate on fake CUDA tensors (FakeTensorMode makes
them on this CPU-only machine), and the replay of a whole step (plan/zero3_replay.py) on a small U-Net."""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers.cli import compose_cfg, preflight
from zerotune.config.schema import MIB
from zerotune.plan import allocator, gpus, zero3, zero3_replay, zero3_runtime
from zerotune.plan.allocator import CachingAllocator, block_size
from zerotune.plan.command_line import platform_for
from zerotune.plan.predict import step_peak
from zerotune.plan.rules import Precision, StepShape, optimizer_temporaries
from zerotune.rundir.plan import Plan, mib_of

CUDA = torch.device("cuda", 0)  # a device object: a device string would ask for the CUDA runtime


# ------------------------------------------------------------------------------------------ the allocator


def test_a_freed_block_is_split_for_a_smaller_request():
    a = CachingAllocator()
    a.free(a.malloc(30 * MIB))
    a.malloc(20 * MIB)  # the 30 MiB block, split: 20 allocated, 10 back in the pool
    assert (a.reserved, a.allocated, a.free_blocks()) == (30 * MIB, 20 * MIB, [10 * MIB])


def test_a_remainder_of_a_mib_or_less_stays_with_the_large_block():
    a = CachingAllocator()
    a.free(a.malloc(12 * MIB))
    a.malloc(11 * MIB + 1)  # 1 MiB - 511 B left: not split, the whole block is allocated (kSmallSize)
    assert (a.allocated, a.free_blocks()) == (12 * MIB, [])


def test_small_blocks_never_come_from_the_large_pool():
    a = CachingAllocator()
    a.free(a.malloc(30 * MIB))
    a.malloc(100 * 1024)  # a new 2 MiB small segment, though a 30 MiB block is free
    assert a.reserved == 32 * MIB and a.free_blocks() == [2 * MIB - 100 * 1024, 30 * MIB]
    assert a.allocated == 100 * 1024  # 512 B multiple already


def test_medium_requests_share_20_mib_segments():
    a = CachingAllocator()
    for _ in range(4):
        a.malloc(5 * MIB)
    assert a.reserved == 20 * MIB
    a.malloc(5 * MIB)
    assert a.reserved == 40 * MIB


def test_the_smallest_free_block_that_fits_is_taken():
    a = CachingAllocator()
    big, fits = a.malloc(40 * MIB), a.malloc(24 * MIB)
    a.free(big)
    a.free(fits)
    a.malloc(22 * MIB)  # the 24 MiB block, 2 MiB left over (split: over 1 MiB)
    assert a.free_blocks() == [2 * MIB, 40 * MIB] and a.reserved == 64 * MIB


def test_free_neighbours_merge_and_empty_cache_releases_whole_segments_only():
    a = CachingAllocator()
    a.free(a.malloc(30 * MIB))
    first, second = a.malloc(10 * MIB), a.malloc(10 * MIB)  # the segment: [first | second | 10 free]
    a.free(first)
    assert a.free_blocks() == [10 * MIB, 10 * MIB]  # not neighbours: no merge
    a.empty_cache()
    assert a.reserved == 30 * MIB  # the segment is split: nothing goes back
    a.free(second)  # merges with both sides
    assert a.free_blocks() == [30 * MIB]
    a.empty_cache()
    assert (a.reserved, a.free_blocks()) == (0, [])


def test_an_event_list_replays_as_the_calls_do():
    events = [("alloc", "a", 30 * MIB), ("free", "a"), ("alloc", "b", 20 * MIB), ("reset_peaks",),
              ("alloc", "c", 20 * MIB), ("free", "b"), ("free", "c"), ("empty_cache",)]
    replayed = allocator.replay(events[:3])
    assert (replayed.reserved, replayed.free_blocks()) == (30 * MIB, [10 * MIB])
    replayed = allocator.replay(events[:-1])  # c did not fit the 10 MiB left: a second segment
    assert (replayed.peak_allocated, replayed.peak_reserved, replayed.reserved) == (40 * MIB, 50 * MIB, 50 * MIB)
    assert allocator.replay(events).reserved == 0  # both segments whole and free: empty_cache returns them
    with pytest.raises(ValueError, match="unknown"):
        allocator.replay([("defragment",)])


def test_peaks_restart_from_what_is_held():
    a = CachingAllocator()
    a.free(a.malloc(30 * MIB))
    assert (a.peak_allocated, a.peak_reserved) == (30 * MIB, 30 * MIB)
    a.reset_peaks()  # torch.cuda.reset_peak_memory_stats
    assert (a.peak_allocated, a.peak_reserved) == (0, 30 * MIB)
    assert a.malloc(0) == 0 and a.allocated == 0  # torch allocates nothing for 0 bytes


@pytest.mark.parametrize("sizes", [[1] * 5, [600 * 1024] * 4, [5 * MIB] * 5, [11 * MIB, 3 * MIB, 700]])
def test_at_once_from_an_empty_pool_the_simulator_meets_perfect_packing(sizes):
    a = CachingAllocator()
    for size in sizes:
        a.malloc(size)
    assert a.reserved == allocator.reserved_bytes(sizes)


def test_zero3_without_offload_reserves_what_sdxl_measured_from_its_large_blocks_alone():
    """SDXL's full U-Net at ZeRO-3 without offload on an H100 (experiments/results/gpu/h100-2026-11-26, grid:
    z3_none_512_bs1): torch reserved 50,520 MiB in step 1 and 62,094 MiB from step 2 on. DeepSpeed's large
    blocks in order (bf16 partitions, fp32 sub-groups of 1,005,669,760 / 1,013,941,760 / 547,852,164 elements,
    each converted then cloned, the largest gradient buffer, the bucket, the gradient partitions; each step: a
    sub-group's gradients flattened, cast to fp32, the optimizer's two states at its first step, foreach's
    sqrt) leave the reserve within 0.2 % of it: the freed fp32 blocks are a few MiB too small for the next
    sub-group, so new segments pile up."""
    subs = [1_005_669_760, 1_013_941_760, 547_852_164]
    a = CachingAllocator()
    a.malloc(2 * sum(subs))
    for n in subs:
        converted = a.malloc(4 * n)
        a.malloc(4 * n)
        a.free(converted)
    a.free(a.malloc(4 * max(subs)))
    a.malloc(2 * 500_000_000)
    a.malloc(2 * sum(subs))
    states, reserved = {}, []
    for _ in range(3):
        a.reset_peaks()
        for i, n in enumerate(subs):
            flat = a.malloc(2 * n)
            grad = a.malloc(4 * n)
            a.free(flat)
            if i not in states:  # the optimizer's two states, at its first step
                states[i] = (a.malloc(4 * n), a.malloc(4 * n))
            a.free(a.malloc(4 * n))
            a.free(grad)
        reserved.append(a.peak_reserved / MIB)
    assert reserved == [50_446, 62_020, 62_020]
    assert reserved[0] == pytest.approx(50_520, rel=0.002) and reserved[1] == pytest.approx(62_094, rel=0.002)


# ------------------------------------------------------------------- the terms, against DeepSpeed's own code


class _Card:
    """What DeepSpeed asks its accelerator, as a CUDA card answers (the device an object: see CUDA)."""

    @staticmethod
    def current_device_name():
        return CUDA

    device_name = current_device_name

    @staticmethod
    def resolves_data_dependency():
        return True

    @staticmethod
    def is_synchronized_device():
        return True

    @staticmethod
    def is_fp64_supported():
        return True

    @staticmethod
    def on_accelerator(tensor):
        return tensor.device.type == "cuda"


def _measured():
    pool = allocator.TaggedPool()
    return pool, allocator.storage_mode(pool)


@pytest.mark.parametrize(("partition_on", "copied"), [(CUDA, 0), (torch.device("cpu"), 1000 * 2)])
def test_one_rank_gathers_a_device_partition_without_a_copy(monkeypatch, partition_on, copied):
    """partition_parameters.py NoGatherHandle: .to(device) of a partition already on the device is the partition
    itself (zero3 gathers nothing on one rank without parameter offload); a host partition is copied whole."""
    from deepspeed.runtime.zero import partition_parameters

    monkeypatch.setattr(partition_parameters, "get_accelerator", lambda: _Card)
    with FakeTensorMode():
        param = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16, device=CUDA))
        param.ds_tensor = torch.empty(1000, dtype=torch.bfloat16, device=partition_on)
        param.ds_shape, param.ds_status = (10, 100), partition_parameters.ZeroParamStatus.INFLIGHT
        pool, mode = _measured()
        mode.ignore(param.ds_tensor)
        with mode:
            partition_parameters.NoGatherHandle(param)
        assert pool.sim.allocated == block_size(copied) and param.shape == (10, 100)


@pytest.mark.parametrize(("world", "numels", "concatenated"), [(1, [300, 500, 200], 1000), (1, [1000], 0),
                                                               (2, [301, 500], 302 + 500)])
def test_a_bucket_flush_concatenates_its_gradients(monkeypatch, world, numels, concatenated):
    """coalesced_collectives.py reduce_scatter_coalesced: one tensor that divides evenly is reduced in place;
    otherwise every gradient, padded to the world size, concatenated; the replay's flush allocates the same."""
    from deepspeed.runtime.comm import coalesced_collectives

    monkeypatch.setattr(coalesced_collectives.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(coalesced_collectives.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(coalesced_collectives, "_torch_reduce_scatter_fn", lambda *a, **k: None)
    with FakeTensorMode():  # on the inputs' device, whichever: fake CPU ones (indexing a fake CUDA one asks for CUDA)
        grads = [torch.empty(n, dtype=torch.bfloat16) for n in numels]
        pool, mode = _measured()
        for grad in grads:  # the bucket's, not the flush's
            mode.ignore(grad)
        with mode:
            out = coalesced_collectives.reduce_scatter_coalesced(grads)
        replayed, replay_mode = _measured()
        reducer = zero3_runtime.Reducer(replayed, replay_mode, world, False, Precision("bf16", 2, 2, 4, False), 2, 10**6,
                                 torch.bfloat16, True)
        reducer.params = [types.SimpleNamespace(ds_numel=n, grad=None) for n in numels]
        reducer.flush()
    assert pool.sim.peak_allocated == replayed.sim.peak_allocated
    assert pool.sim.peak_allocated >= block_size(concatenated * 2) and replayed.sim.allocated == 0
    assert [t.numel() for t in out] == [-(-n // world) if world > 1 else n for n in numels]


def test_a_sub_groups_fp32_gradient_is_flattened_then_cast(monkeypatch):
    """stage3.py _prepare_fp32_grad_for_sub_group (line 2686): the bf16 gradients flattened, the flat copy cast to
    fp32 and kept as the fp32 partition's .grad; zero3 counts 6 B then 4 B per element of the sub-group."""
    from deepspeed.runtime.zero import stage3

    monkeypatch.setattr(stage3, "get_accelerator", lambda: _Card)
    monkeypatch.setattr(stage3.dist, "get_rank", lambda group=None: 0)
    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    with FakeTensorMode():
        grads = [torch.empty(n, dtype=torch.bfloat16, device=CUDA) for n in (3000, 5000)]
        fp32 = torch.empty(8000, dtype=torch.float32, device=CUDA)
        stub = types.SimpleNamespace(flatten=torch._utils._flatten_dense_tensors, averaged_gradients={0: grads},
                                     fp32_partitioned_groups_flat=[fp32], _get_sub_group_process_group=lambda i: None)
        pool, mode = _measured()
        for held in (*grads, fp32):  # the gradient partitions and the master: the engine's already
            mode.ignore(held)
        with mode:
            cls._prepare_fp32_grad_for_sub_group(stub, 0)
        assert pool.sim.peak_allocated == block_size(8000 * 2) + block_size(8000 * 4)
        assert pool.sim.allocated == block_size(8000 * 4) and fp32.grad.dtype == torch.float32


def test_the_offloaded_partition_comes_back_for_its_norm_and_fp32_copy(monkeypatch):
    """stage3.py partition_grads with optimizer offload, at the accumulation boundary: the partition back on
    the device (line 2028), its norm in fp64 (line 1964), its fp32 copy (line 1457), one parameter at a time:
    zero3's grad_copies, 2 + 8 B per element at most."""
    from deepspeed.runtime.zero import stage3, utils

    for module in (stage3, utils):
        monkeypatch.setattr(module, "get_accelerator", lambda: _Card)
    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    n = 4096
    with FakeTensorMode():
        param = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device=CUDA))
        param.ds_id, param.ds_numel, param.partition_numel = 0, n, lambda: n
        host_grad = torch.empty(n, dtype=torch.bfloat16)  # the pinned partition buffer
        fp32 = torch.empty(n, dtype=torch.float32)
        fp32.grad = torch.empty(n, dtype=torch.float32)
        stub = types.SimpleNamespace(
            _get_param_partition_rank=lambda p: 0, _offload_boundary_param_ids=set(), micro_step_id=0,
            offload_optimizer=True, is_gradient_accumulation_boundary=lambda: True, grad_position={0: [0, 0, n]},
            get_param_id=lambda p: p.ds_id, norm_for_param_grads={}, _swappable_optimizer_subgroup=lambda i: False,
            fp32_partitioned_groups_flat=[fp32], master_weights_and_grads_dtype=torch.float32,
            gradient_accumulation_dtype=torch.bfloat16, swap_optimizer=False,
            _DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition={0: host_grad})
        for name in ("_offload_grad_partition_at_boundary", "_constant_buffered_norm2",
                     "_swap_out_offload_fp32_gradients"):
            setattr(stub, name, types.MethodType(getattr(cls, name), stub))
        partition = torch.empty(n, dtype=torch.bfloat16, device=CUDA)
        pool, mode = _measured()
        for held in (param, host_grad, fp32, fp32.grad, partition):  # the engine's and the flush's already
            mode.ignore(held)
        with mode:
            cls.partition_grads(stub, [param], [partition])
        replayed, replay_mode = _measured()
        reducer = zero3_runtime.Reducer(replayed, replay_mode, 1, True, Precision("bf16", 2, 2, 4, False), 2, 10**6,
                                 torch.bfloat16, True)
        reducer.params = [types.SimpleNamespace(ds_numel=n, grad=None)]
        reducer.flush()
    assert pool.sim.peak_allocated == block_size(n * 2) + block_size(n * 8) + 512  # + the norm, a 0-d tensor
    assert replayed.sim.peak_allocated == pool.sim.peak_allocated and replayed.sim.allocated == pool.sim.allocated
    assert param.grad is None and set(stub.norm_for_param_grads) == {0}


def test_foreach_adamw_adds_one_fp32_tensor_per_sub_group():
    """torch's AdamW, foreach on CUDA tensors, as stage 3 steps it: one sub-group per optimizer.step(); the states
    at the first step, then one temporary (_foreach_sqrt) the size of the sub-group: step_peak's rule for one."""
    n = 1000
    with FakeTensorMode():
        param = torch.nn.Parameter(torch.zeros(n, device=CUDA))
        param.grad = torch.zeros(n, device=CUDA)
        optimizer = torch.optim.AdamW([param], foreach=True)
        pool, mode = _measured()
        with mode:
            optimizer.step()
            held = pool.sim.allocated
            pool.reset()
            optimizer.step()
        assert held == 2 * block_size(n * 4) + 512  # exp_avg, exp_avg_sq (+ `step`, a 0-d tensor)
        temporaries = optimizer_temporaries(StepShape(3, True, "torch.optim.AdamW", 2, 4, False, n, n, "cuda"), "cuda")
        assert pool.sim.peak_allocated - held == block_size(mib_of(temporaries) * MIB)


# ----------------------------------------------------------------------------------------------- the replay


def _checked(*overrides: str):
    ov = ["model=sdxl_tiny", "data=synthetic", "precision=bf16", "zero_stage=3", "resolution=64",
          "train.batch_size=2", "train.gradient_checkpointing=true", "evaluate.enabled=false",
          "checkpoint.final=false", *overrides]
    card = gpus.lookup("h100")
    checked = preflight(compose_cfg(*ov), overrides=ov, platform=platform_for(card))
    return checked.config, checked, card


@pytest.fixture()
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(zero3_replay, "_REPLAYS", {})


@pytest.mark.usefixtures("cache")
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_replayed_step_adds_up_to_its_reserved_peak(offload):
    cfg, checked, card = _checked(f"offload={offload}", "deepspeed.stage3_param_persistence_threshold=0")
    found = zero3_replay.step_memory(cfg, checked, card)
    steps = found["steps"]
    assert len(steps) == zero3_replay.REPLAY_STEPS and steps[2]["reserved"] == steps[1]["reserved"]  # steady from step 2
    assert steps[1]["allocated"] >= steps[0]["allocated"]  # step 2 prefetches and keeps what it reuses
    for step in steps:
        assert step["reserved"] >= step["allocated"] >= found["loading"]["allocated"] - 1
    tags = {tag for step in steps for tag in step["at_allocated_peak"]["tags"]}
    # one rank: partitions on the device are the gathered parameters themselves; offloaded ones are copied in
    assert ("gathered_params" in tags) == (offload == "cpu") and ("grad_copies" in tags) == (offload == "cpu")
    assert ("optimizer_states" in tags) == (offload == "none")
    terms = zero3_replay.step_terms(cfg, checked, card)
    peak, _ = step_peak(terms)
    assert peak * MIB == pytest.approx(max(s["reserved"] for s in steps), abs=1)
    assert all(t.note for t in terms) and "allocator_reserve" in {t.term for t in terms}
    assert zero3_replay.step_memory(cfg, checked, card) is found  # this process's cache


@pytest.mark.usefixtures("cache")
def test_the_trainer_empties_the_cache_after_the_build():
    """train/trainer.py Trainer._prepare (d6e1446): the build's freed segments go back before the first step;
    emptied=False replays the trainer rows were recorded with, its cache kept."""
    cfg, checked, card = _checked("offload=none")
    today, before = (zero3_replay.step_memory(cfg, checked, card, emptied) for emptied in (True, False))
    # only whole free segments go back (this small build shares its segments with live blocks: none here)
    assert today["loading"]["end_reserved"] <= today["loading"]["reserved"] == before["loading"]["end_reserved"]
    assert today is not before and today["key"] != before["key"]
    phase = zero3.loading(cfg, checked, card, Plan(), [])
    assert phase.end_live_mib * MIB == pytest.approx(today["loading"]["end_reserved"])


@pytest.mark.usefixtures("cache")
def test_the_loading_phase_is_the_replayed_engine_build():
    cfg, checked, card = _checked("offload=none")
    phase = zero3.loading(cfg, checked, card, Plan(), [])
    terms = {t.term: t.mib for t in phase.terms}
    elements = sum(checked.model_stats.param_numels)
    assert terms["params"] == pytest.approx(block_size(2 * elements) / MIB, abs=2)  # one flat bf16 buffer
    assert terms["master_weights"] >= 4 * elements / MIB and terms["grads"] >= 2 * elements / MIB
    assert phase.peak_mib == pytest.approx(zero3_replay.loading_memory(cfg, checked)["reserved"] / MIB)


@pytest.mark.usefixtures("cache")
def test_a_card_plan_at_zero3_takes_its_step_from_the_replay():
    from zerotune.plan.allocator import CONTEXT
    from zerotune.plan.predict import predict

    cfg, checked, card = _checked("offload=cpu")
    plan = predict(checked, card)
    replayed = zero3_replay.step_terms(cfg, checked, card)
    assert {t.term for t in plan.gpu_terms} == {"cuda_context"} | {t.term for t in replayed}
    assert plan.step_peak_mib == pytest.approx(CONTEXT[card.family]["bytes"] / MIB + step_peak(replayed)[0])
    # no card named: nothing to replay for (no context, no workspace), the rules' sum stands
    unknown = {t.term for t in predict(checked, None).gpu_terms}
    assert "allocator_rounding" in unknown and "allocator_reserve" not in unknown


def test_the_replay_is_keyed_by_what_it_reads():
    """A tune's candidates that differ only where the replay does not read share one replay (about 45 s for
    SDXL); a setting it reads gives another."""
    def key(*overrides: str) -> str:
        cfg, checked, card = _checked("offload=cpu", *overrides)
        return zero3_replay._replay_key(cfg, checked, card.family)

    base = key("deepspeed.overlap_comm=false")
    assert key("deepspeed.overlap_comm=true") == base
    assert key("deepspeed.reduce_bucket_size=1000000") != base and key("offload=none") != base

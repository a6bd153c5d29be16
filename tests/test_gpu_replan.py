"""benchmarks/gpu/replan.py: a row recorded before zerotune emptied the cache after the engine's build is replanned
as it ran then, the loading's freed blocks under the step where the step's tensors cannot reuse them."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.gpu.replan import as_run_before_the_build_emptied_the_cache
from zerotune.rundir.plan import Phase, Plan, Term


def answer(master_on_gpu: float, step_peak: float) -> Plan:
    loading = Phase("loading", 25_000.0, (Term("master_partition_clone", 4_898.0),), "", freed_at_end_mib=9_980.0)
    step = Phase("step", step_peak, (), "")
    return Plan.made(phases=[loading, step], run_peak_mib=max(25_000.0, step_peak),
                     gpu_terms=[Term("master_weights", master_on_gpu)])


def test_the_step_tensors_larger_than_every_freed_block_add_to_it():
    # no offload, one group: Adam's moments and the fp32 gradient partition are 9,794 MiB each, the clone 4,898
    assert as_run_before_the_build_emptied_the_cache(answer(9_794.0, 55_000.0), 1) == 55_000.0 + 9_980.0


def test_step_tensors_that_fit_the_freed_blocks_reuse_them():
    # offload: the master partition lives on the host; the card's step tensors fit into what the loading freed
    assert as_run_before_the_build_emptied_the_cache(answer(0.0, 7_600.0), 1) == 25_000.0
    # 16 groups: each group's partition (612 MiB in fp32) fits into the freed clone's block
    assert as_run_before_the_build_emptied_the_cache(answer(9_794.0, 55_000.0), 16) == 55_000.0


def test_a_plan_without_freed_blocks_is_its_own_run_peak():
    plan = answer(9_794.0, 55_000.0)
    loading, step = plan.phases
    plan = plan.adding(phases=[replace(loading, freed_at_end_mib=None), step])
    assert as_run_before_the_build_emptied_the_cache(plan, 1) == plan.run_peak_mib

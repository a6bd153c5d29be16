"""The planner's whole training step (plan/predict.py): what it holds throughout plus its largest moment,
checked against what torch really allocates on this CPU for the same step through zerotune's own trainer
(benchmarks/step_alloc.py); and the CUDA branches that differ from the CPU's, each where DeepSpeed and torch
decide them. The whole grid (2 models x stages 0-3 x offload none/cpu x fp32/bf16) is slow; one
configuration runs in the default suite."""

from __future__ import annotations

import pytest

from benchmarks.bench_plan_step import compare, configs
from tests.helpers.cli import compose_cfg, preflight
from zerotune.host.platform import ANY_CUDA_GPU
from zerotune.plan import gpus
from zerotune.plan.predict import MOMENTS, predict
from zerotune.rundir.plan import Plan, at_peak, mib_of

GRID = configs(["tiny", "sdxl_tiny"], [0, 1, 2, 3], ["none", "cpu"], ["fp32", "bf16"])
QUICK = [("tiny", 0, "none", "bf16")]  # the stage-0 step transient the planner lacked; the rest under -m slow


def _check(config: tuple) -> None:
    row = compare(config, {})
    assert 0.9 <= row["ratio"] <= 1.1, row


@pytest.mark.parametrize("config", QUICK, ids=lambda c: "-".join(map(str, c)))
def test_the_step_peak_matches_what_torch_allocates(config):
    _check(config)


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in GRID if c not in QUICK], ids=lambda c: "-".join(map(str, c)))
def test_the_step_peak_matches_what_torch_allocates_across_the_grid(config):
    _check(config)


def _plan(*overrides: str, device: str = "cuda") -> Plan:
    cfg = compose_cfg("model=sdxl", "resolution=1024", "train.batch_size=1", "precision=bf16", *overrides)
    gpu = gpus.CATALOG["rtx4090"] if device == "cuda" else None
    checked = preflight(cfg, overrides=list(overrides), platform=ANY_CUDA_GPU if gpu else None)
    return predict(checked, gpu, device=device)


def _terms(plan: Plan, key: str = "gpu_terms") -> dict[tuple[str, str], float]:
    return {(t.term, t.held_in): t.mib for t in getattr(plan, key)}


def test_stage0_bf16_holds_fp32_gradient_copies_inside_the_step_on_cuda_and_on_this_cpu():
    numel, mib = 2_567_463_684, 2**20  # SDXL's U-Net
    # zerotune's default without offload is torch's AdamW (deepspeed.torch_adam=auto): FP16_UnfusedOptimizer,
    # one fp32 copy per gradient; on CUDA tensors AdamW runs foreach: one temporary per state tensor, all at once
    cuda = _terms(_plan("zero_stage=0", "offload=none"))
    assert cuda[("step_fp32_grads", "step:update")] == pytest.approx(numel * 4 / mib)
    assert cuda[("optimizer_temporaries", "step:update")] == pytest.approx(numel * 4 / mib)
    # FusedAdam: FP16_Optimizer casts every gradient to fp32 and flattens them, both at once; FusedAdam
    # updates in place
    fused = _terms(_plan("zero_stage=0", "offload=none", "deepspeed.torch_adam=false"))
    assert fused[("step_fp32_grads", "step:flatten")] == pytest.approx(numel * 8 / mib)
    assert fused[("step_fp32_grads", "step:update")] == pytest.approx(numel * 4 / mib)
    assert not any(name == "optimizer_temporaries" for name, _ in fused)
    # this CPU: AdamW one tensor at a time, two temporaries of the largest parameter
    cpu = _plan("zero_stage=0", "offload=none", device="cpu")
    terms = _terms(cpu, "step_terms")
    assert terms[("step_fp32_grads", "step:update")] == pytest.approx(numel * 4 / mib)
    largest = preflight(compose_cfg("model=sdxl", "resolution=1024")).model_stats.largest_param_numel
    assert terms[("optimizer_temporaries", "step:update")] == pytest.approx(2 * largest * 4 / mib)
    assert cpu.gpu_peak_mib is None and cpu.step_peak_moment == "step:update"


def test_the_step_peak_is_what_it_holds_plus_its_largest_moment():
    plan = _plan("zero_stage=2", "offload=none")
    at = {m: mib_of(at_peak(plan.gpu_terms, m)) for m in MOMENTS}
    assert plan.gpu_peak_mib == pytest.approx(max(at.values())) == pytest.approx(at[plan.step_peak_moment])
    # an activation peak and the optimizer's transients never coincide: the sum of all terms is more
    assert mib_of(plan.gpu_terms) > plan.gpu_peak_mib


def test_stage0_no_longer_ranks_below_stages_1_and_2():
    stage0, stage2 = _plan("zero_stage=0", "offload=none"), _plan("zero_stage=2", "offload=none")
    assert stage0.gpu_peak_mib > stage2.gpu_peak_mib

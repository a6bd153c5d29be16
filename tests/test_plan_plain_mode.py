"""The planner without DeepSpeed (deepspeed.enabled=false: plain accelerate, as the other trainers run): fp32
weights under autocast, each term checked against the code that allocates it, on this CPU.

- autocast: the step traced with the weights in fp32 and the forward under torch.autocast (activations.plain_trace),
  against the same step run for real; the half-precision copies of the weights against autocast's own cache; for a
  CUDA plan, CUDA's cast policy read from torch's own header and applied to CPU tensors (cast_policy);
- gradient accumulation: the earlier micro-steps' gradients held through the next forward and backward;
- DDP: its gradient buckets (a second copy of the trained gradients) and the broadcast at its construction;
- the whole step through zerotune's own Trainer (benchmarks/step_alloc.py), where all of them meet;
- on a card, the peak where the step has it: the backward with the gradients growing, or a later micro-step.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tests.helpers.cli import compose_cfg, preflight
from zerotune.host.platform import ANY_CUDA_GPU
from zerotune.models import latent_shape
from zerotune.plan import activations, gpus, model_states, stage0
from zerotune.plan.activations import measure_step_on_cpu, trace_step
from zerotune.plan.predict import predict
from zerotune.plan.stage0 import (
    ACCUMULATING,
    cast_policy,
    cuda_autocast_policies,
    ddp_broadcast_bytes,
    plain_buffers,
)
from zerotune.rundir.plan import PERSISTENT, Plan, mib_of

PLAIN = ("deepspeed.enabled=false", "zero_stage=0")


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory):
    """One trace cache for the module, empty at its start."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        patch.setattr(activations, "_TRACES", {})
        yield


def _model(name: str):
    from zerotune.config.compose.settle import settle

    return settle(compose_cfg(f"model={name}", "data=synthetic")).config.model


def _held(prof) -> list[int]:
    """The running total of CPU allocations and frees, in order, from torch.profiler's event tree (its flat event list
    misses frees made on another thread: gloo's broadcast frees its bucket on its worker's)."""
    found = []

    def walk(events) -> None:
        for e in events:
            if type(e.extra_fields).__name__ == "_ExtraFields_Allocation":
                found.append((e.start_time_ns, e.extra_fields.alloc_size > 0, e.extra_fields.alloc_size))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    return list(itertools.accumulate(n for _, _, n in sorted(found)))


# ------------------------------------------------------------------------------------------------- autocast


def test_cuda_policy_is_torchs_own_header():
    """The op lists parsed from ATen/autocast_mode.h are what torch registers for CUDA's autocast key (the rest of
    those registrations are in autocast_mode.cpp: cudnn_convolution*, norm, the banned binary_cross_entropy)."""
    policies = cuda_autocast_policies()
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    assert set(policies) <= registered and len(registered - set(policies)) <= 6
    # the U-Net's ops: matmuls and convolutions in half precision, norms, softmax and upsampling in fp32
    assert {policies[op] for op in ("aten::conv2d", "aten::linear", "aten::scaled_dot_product_attention",
                                    "aten::baddbmm")} == {"lower_precision_fp"}
    assert {policies[op] for op in ("aten::group_norm", "aten::layer_norm", "aten::upsample_nearest2d")} == {"fp32"}
    assert policies["aten::softmax.int"] == "fp32_set_opt_dtype"


def test_cast_policy_gives_cpu_tensors_cudas_casts_and_then_leaves():
    x, w = torch.randn(2, 8, 4, 4), torch.nn.Parameter(torch.randn(8, 8, 3, 3))

    def dtypes() -> tuple:
        with torch.autocast("cpu", dtype=torch.float16):
            y = F.conv2d(x, w, padding=1)
            return (y.dtype, F.group_norm(y, 2).dtype, F.layer_norm(y, (4,)).dtype, torch.softmax(y, -1).dtype,
                    F.interpolate(y, scale_factor=2.0).dtype, torch.cat([y, x]).dtype, y.sum().dtype)

    half, single = torch.float16, torch.float32
    cpu_own = (half, half, half, half, half, single, half)  # CPU's lists: norms and softmax in the autocast dtype
    assert dtypes() == cpu_own
    with cast_policy("cuda"):
        assert dtypes() == (half, single, single, single, single, single, single)
    assert dtypes() == cpu_own  # the kernels are gone again


@pytest.mark.parametrize("model,size,checkpointing,device", [
    ("tiny", 32, False, "cpu"), ("tiny", 32, True, "cuda"),
    ("sdxl_tiny", 64, False, "cuda"), ("sdxl_tiny", 64, True, "cpu")])
def test_the_plain_trace_is_the_real_steps(model, size, checkpointing, device):
    """fp32 weights, the forward under autocast (CPU's policy in bf16; CUDA's in fp16, on CPU tensors), run for
    real: the traced peak is the allocator's, autocast's weight copies included."""
    cfg = _model(model)
    shape, precision = latent_shape(cfg, size), "bf16" if device == "cpu" else "fp16"
    traced = trace_step(cfg, shape, 2, precision, checkpointing, str(cfg.attention), None, device)
    real = measure_step_on_cpu(cfg, shape, 2, checkpointing, str(cfg.attention), precision, None, device)
    assert 0.97 <= traced.activation_peak_bytes / real.between_ops <= 1.03, (traced, real)
    assert traced.grad_bytes == traced.param_bytes  # fp32 gradients of fp32 weights


def test_the_weight_copies_are_autocasts_cache():
    """With no gradient to keep anything, what a forward under CPU autocast still holds before autocast exits is its
    cache: one bf16 copy of each fp32 weight a lower-precision op read (autocast_mode.cpp cached_cast). The trace
    counts the same copies, all alive at the forward's end."""
    cfg = _model("sdxl_tiny")
    shape, attention = latent_shape(cfg, 64), str(cfg.attention)
    traced = trace_step(cfg, shape, 2, "bf16", False, attention, None, "cpu")
    unet = activations._as_trained(cfg, "fp32", False, attention)
    inputs = activations._inputs(cfg, shape, 2, torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            activations._loss(unet, cfg, inputs)  # the loss dropped: only the cache is left
        cached = _held(prof)[-1]
    read = sum(p.numel() * 2 for m in unet.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
               for p in m.parameters(recurse=False))
    assert traced.weight_copies_peak_bytes == cached == read


# ------------------------------------------------------------------------- accumulation and DDP (stage0.py)


def test_accumulation_holds_the_trained_gradients_for_a_later_micro_step():
    trained = [3, 5, 7]
    assert plain_buffers({"gradient_accumulation_steps": 1}, trained, 1) == []
    (kept,) = plain_buffers({"gradient_accumulation_steps": 4}, trained, 1)
    assert (kept.term, kept.nbytes, kept.moment) == ("accumulated_grads", 15 * 4, ACCUMULATING)
    assert "AccumulateGrad" in kept.note and "sync_gradients" in kept.note


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (DDP builds its reducer as for any world)."""
    if dist.is_initialized():  # one an earlier test left up: usable as it is when it has one rank
        if dist.get_world_size() != 1:
            pytest.skip(f"a process group of {dist.get_world_size()} ranks is already up in this process")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_keeps_a_second_copy_of_the_trained_gradients(world_of_one):
    """DistributedDataParallel's reducer: every trained gradient copied into flat buckets it keeps (the frozen
    parameters get none), the same bytes at every iteration. A comm hook sees each bucket's flat tensor
    (GradBucket.buffer) as the reducer reduces it."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 3000), torch.nn.Linear(3000, 3000), torch.nn.Linear(3000, 8))
    model[0].requires_grad_(False)
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    (buckets,) = [t for t in plain_buffers({}, trained, 2) if t.term == "ddp_gradient_buckets"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    seen: list[list[int]] = []

    def hook(state, bucket):
        seen[-1].append(bucket.buffer().untyped_storage().nbytes())
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, hook)
    x = torch.randn(4, 64)
    for _ in range(3):
        seen.append([])
        ddp(x).sum().backward()
        model.zero_grad(set_to_none=True)
    assert [sum(found) for found in seen] == [buckets.nbytes] * 3 == [sum(trained) * 4] * 3
    assert ddp.broadcast_bucket_size == stage0.DDP_BROADCAST_BUCKET and not ddp.gradient_as_bucket_view


def test_ddps_broadcast_holds_two_buckets_at_once(world_of_one):
    """_sync_module_states at DDP's construction: the parameters flattened into buckets that close once they pass
    the bucket size, two in flight (here with a small bucket size, to see several)."""
    from torch.distributed.utils import _sync_module_states

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256 + i, bias=False) for i in range(9)])
    numels, cap = [p.numel() for p in model.parameters()], 600_000
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _sync_module_states(model, dist.group.WORLD, cap, 0, set())
    held = _held(prof)
    assert held[-1] == 0 and max(held) == ddp_broadcast_bytes(numels, 4, cap)


def test_ddp_wraps_the_module_with_several_processes_or_on_a_cpu():
    assert not plain_buffers({}, [3], 1) and not plain_buffers({}, [3], 1, "cuda")
    assert [t.term for t in plain_buffers({}, [3], 1, "cpu")] == ["ddp_gradient_buckets"]
    assert [t.term for t in plain_buffers({}, [3], 2)] == ["ddp_gradient_buckets"]
    plain = model_states.Partitioning([3, 5], {}, 2, use_deepspeed=False, trainable_numels=[5])
    assert plain.gpu_buffer_bytes() == {"ddp_gradient_buckets": 20}


# --------------------------------------------------------------------- the whole step through zerotune's Trainer

# benchmarks/step_alloc.py runs the second step through zerotune's own Trainer and reads torch's allocator
# (accelerate's CPU autocast in bf16; DDP at one process: accelerate's MULTI_CPU). tiny: the weights' copies and
# gradients outweigh the activations; sdxl_tiny at 128 px with checkpointing: a later micro-step holds more.
STEPS = [pytest.param(("model=tiny", "resolution=16", "train.grad_accum=2"), id="tiny-ga2"),
         pytest.param(("model=sdxl_tiny", "resolution=128", "train.grad_accum=2", "train.gradient_checkpointing=true"),
                      id="sdxl_tiny-128px-gc-ga2", marks=pytest.mark.slow),
         pytest.param(("model=sdxl_tiny", "resolution=64"), id="sdxl_tiny-64px", marks=pytest.mark.slow)]


@pytest.mark.parametrize("settings", STEPS)
def test_the_plain_step_is_what_the_trainer_allocates(settings):
    from benchmarks.step_alloc import QUICK
    from zerotune.config.compose import compose

    overrides = [*QUICK, *settings, *PLAIN, "precision=bf16"]
    real = _step_alloc(overrides)
    # a CPU plan: accelerate wraps even one process in DDP here, and the plan's buffers say so
    plan = predict(preflight(compose(overrides), 1, overrides=overrides), None, device="cpu")
    held = mib_of(t for t in plan.step_terms if t.held_in == PERSISTENT) * 2**20
    # What the step adds to what it holds throughout (activations, autocast's copies, gradients, the optimizer's
    # temporaries), against the same in the run; then what it holds throughout (the model states, DDP's buckets).
    # The profiler can miss one free made on gloo's thread, DDP's construction broadcast of the parameters: the
    # run's held figure then carries one flat copy of them for good, so it is checked from below and above.
    ratio = (plan.step_peak_mib * 2**20 - held) / (real["peak_between_ops"] - real["held_at_start"])
    assert 0.95 <= ratio <= 1.05, (plan.step_peak_moment, ratio, held, real)
    params = plan.trainable_params * 4
    assert held * 0.99 <= real["held_at_start"] <= held * 1.01 + params, (held, real)
    accumulating = any(s == "train.grad_accum=2" for s in settings)
    assert (plan.step_peak_moment == ACCUMULATING) == accumulating


def _step_alloc(overrides: list[str]) -> dict:
    """benchmarks/step_alloc.py's figures for these overrides, in its own process (accelerate's state is global)."""
    from tests.helpers.cli import ROOT

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_alloc.py"), *overrides], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------- on a card


def _card_plan(*overrides: str) -> Plan:
    cfg = compose_cfg("model=sdxl_tiny", "resolution=256", "train.batch_size=2", "optimizer=adamw8bit",
                      "precision=fp16", "data=synthetic", *PLAIN, *overrides)
    checked = preflight(cfg, overrides=list(overrides), platform=ANY_CUDA_GPU)
    return predict(checked, gpus.CATALOG["rtx4090"])


def _terms(plan: Plan) -> dict[tuple[str, str], float]:
    return {(t.term, t.held_in): t.mib for t in plan.gpu_terms}


def test_on_a_card_the_plain_step_peaks_where_its_memory_is():
    """Large activations beside 8-bit states: the peak is the backward (or a later micro-step's forward and
    backward), not the optimizer's step, and it moves with checkpointing and accumulation as the sources' do."""
    plain, checkpointed, accumulating = (_card_plan(*extra) for extra in (
        (), ("train.gradient_checkpointing=true",), ("train.grad_accum=2",)))
    assert plain.step_peak_moment == checkpointed.step_peak_moment == "forward+backward"
    assert accumulating.step_peak_moment == ACCUMULATING
    assert checkpointed.step_peak_mib < plain.step_peak_mib < accumulating.step_peak_mib
    terms, trained = _terms(accumulating), plain.trainable_params * 4 / 2**20
    assert terms[("deepspeed:accumulated_grads", ACCUMULATING)] == pytest.approx(trained)
    assert terms[("autocast_weight_copies", ACCUMULATING)] > 0
    # the step the planner predicted before, from a module cast to fp16: below the backward's fp32 gradients
    assert ("grads", "step:update") in terms and terms[("grads", "step:update")] == pytest.approx(trained)


def test_on_a_card_the_trace_takes_cudas_casts():
    """CUDA's autocast runs the norms in fp32: more activation memory than CPU's policy for the same step."""
    cfg = _model("sdxl_tiny")
    base = trace_step(cfg, latent_shape(cfg, 128), 2, "fp16", False, str(cfg.attention))
    cpu, cuda = (activations.plain_trace(base, device) for device in ("cpu", "cuda"))
    assert cuda.activation_peak_bytes > 1.2 * cpu.activation_peak_bytes
    assert cuda.weight_copies_peak_bytes == cpu.weight_copies_peak_bytes > 0
    assert activations.plain_trace(trace_step(cfg, (4, 16, 16), 2, "fp32", False, str(cfg.attention)), "cuda") \
        .weight_copies_peak_bytes == 0  # fp32: no autocast


def test_plain_loading_moves_the_fp32_module_and_builds_ddp_with_several_processes():
    one, two = (_card_plan(f"launch.num_processes={n}") for n in (1, 2))
    loading = [{t.term: t.mib for t in p.phases[0].terms} for p in (one, two)]
    assert loading[0]["unet_parameters"] >= one.trainable_params * 4 / 2**20
    assert "ddp_gradient_buckets" not in loading[0]
    assert loading[1]["ddp_gradient_buckets"] == pytest.approx(two.trainable_params * 4 / 2**20)
    assert loading[1]["ddp_broadcast_buckets"] > 0
    assert _terms(two)[("deepspeed:ddp_gradient_buckets", "persistent")] == loading[1]["ddp_gradient_buckets"]

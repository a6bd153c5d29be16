"""The planner's fake-tensor trace of a training step: its activation peak against the same step run for
real on the CPU, its cache, and its FLOPs against FlopCounterMode's."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.cli import compose_cfg
from zerotune.config.compose.settle import settle
from zerotune.config.errors import ConfigError
from zerotune.models import latent_shape, model_stats
from zerotune.plan import activations
from zerotune.plan.activations import measure_step_on_cpu, trace_step
from zerotune.plan.step_tracker import FLOP_FORMULAS

aten = torch.ops.aten

# Three input sizes per model (pixels; tiny has no VAE, sdxl_tiny's encodes by 4), with and without
# gradient checkpointing: 12 steps, each traced and run for real in a few seconds at batch 2.
CASES = [(model, size, checkpointing) for model, sizes in (("tiny", (8, 16, 32)), ("sdxl_tiny", (64, 128, 256)))
         for size in sizes for checkpointing in (False, True)]
# The largest traces (about 15 s each) run with -m slow: 64 and 128 px check the same code in the default suite.
SLOW_IDS = {"sdxl_tiny-256px-nogc", "sdxl_tiny-256px-gc", "sdxl_tiny-128px-gc-lora"}


def cases(listed: list, suffix: str = "") -> list:
    ids = [f"{m}-{s}px-{'gc' if c else 'nogc'}{suffix}" for m, s, c in listed]
    return [pytest.param(*case, id=i, marks=pytest.mark.slow if i in SLOW_IDS else ()) for case, i in zip(listed, ids, strict=True)]


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """One trace cache for the module's tests, empty at its start: a step traced by one test (the 128 px U-Net's
    with and without checkpointing, say) is read by the next that asks for it, as the planner reads it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        patch.setattr(activations, "_TRACES", {})
        yield


@pytest.fixture(autouse=True)
def shared_cache(module_cache):
    """Every test but the cache's own reads and writes the module's cache."""


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """The cache's own tests: their own folder, traced afresh."""
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(activations, "_TRACES", {})


def _settled(*overrides: str):
    """The job's config as the planner takes it: composed and settled (config/compose/settle.py)."""
    return settle(compose_cfg(*overrides)).config


def _model(name: str):
    return _settled(f"model={name}", "data=synthetic").model


@pytest.mark.parametrize("model,size,checkpointing", cases(CASES))
def test_traced_activation_peak_is_the_real_steps(model, size, checkpointing):
    cfg = _model(model)
    shape = latent_shape(cfg, size)
    traced = trace_step(cfg, shape, 2, "fp32", checkpointing, str(cfg.attention))
    real = measure_step_on_cpu(cfg, shape, 2, checkpointing, str(cfg.attention))
    ratio = traced.activation_peak_bytes / real.between_ops
    assert 0.9 <= ratio <= 1.1, f"traced {traced.activation_peak_bytes:,} B, real {real.between_ops:,} B"


# LoRA: the base U-Net frozen (no weight gradients, only what its ops save for the input gradients), the
# adapter's branches on the targets (tiny: the resnets' convolutions; sdxl_tiny: attention projections).
LORA_CASES = [("tiny", 16, False), ("sdxl_tiny", 128, False), ("sdxl_tiny", 128, True)]


@pytest.mark.parametrize("model,size,checkpointing", cases(LORA_CASES, "-lora"))
def test_traced_activation_peak_is_the_real_steps_with_lora(model, size, checkpointing):
    cfg = _settled(f"model={model}", "data=synthetic", "adapter=lora")
    shape = latent_shape(cfg.model, size)
    traced = trace_step(cfg.model, shape, 2, "fp32", checkpointing, str(cfg.model.attention), cfg.adapter)
    real = measure_step_on_cpu(cfg.model, shape, 2, checkpointing, str(cfg.model.attention), adapter_cfg=cfg.adapter)
    ratio = traced.activation_peak_bytes / real.between_ops
    assert 0.9 <= ratio <= 1.1, f"traced {traced.activation_peak_bytes:,} B, real {real.between_ops:,} B"
    stats = model_stats(cfg.model, cfg.adapter)
    assert traced.param_bytes == stats.num_params * 4 and traced.grad_bytes == stats.num_trainable * 4


def test_checkpointing_lowers_the_peak_and_adds_recomputation():
    cfg = _model("sdxl_tiny")  # the 128 px steps test_traced_activation_peak_is_the_real_steps traced
    full, checkpointed = (trace_step(cfg, (4, 32, 32), 2, "fp32", gc, str(cfg.attention)) for gc in (False, True))
    assert checkpointed.activation_peak_bytes < full.activation_peak_bytes / 2
    assert checkpointed.forward_flops == full.forward_flops
    assert checkpointed.backward_flops > full.backward_flops


def test_parameters_and_gradients_at_the_traced_precision():
    cfg = _model("sdxl_tiny")
    params = model_stats(cfg).num_params
    for precision, size in (("bf16", 2), ("fp16", 2), ("fp32", 4)):  # fp32: the traced 64 px step's
        trace = trace_step(cfg, (4, 16, 16), 2, precision, False, str(cfg.attention))
        assert trace.param_bytes == trace.grad_bytes == params * size, precision


def test_a_cached_trace_is_returned_without_tracing(private_cache, monkeypatch):
    cfg = _model("tiny")
    first = trace_step(cfg, (1, 16, 16), 2, "bf16", True, "default")
    assert trace_step(cfg, (1, 16, 16), 2, "bf16", True, "default") is first
    assert (activations.cache_dir() / f"trace-{first.key}.json").is_file()

    def no_tracing(*args):
        raise AssertionError("traced again")

    monkeypatch.setattr(activations, "_trace", no_tracing)
    monkeypatch.setattr(activations, "_TRACES", {})  # a new process: the disk cache answers
    assert trace_step(cfg, (1, 16, 16), 2, "bf16", True, "default") == first


def test_every_setting_has_its_own_key():
    cfg = _model("tiny")
    base = ((1, 16, 16), 2, "bf16", True, "default")
    variants = [((1, 32, 32), 2, "bf16", True, "default"), ((1, 16, 16), 4, "bf16", True, "default"),
                ((1, 16, 16), 2, "fp16", True, "default"), ((1, 16, 16), 2, "bf16", False, "default"),
                ((1, 16, 16), 2, "bf16", True, "sdpa")]
    keys = {activations.trace_key(cfg, *settings) for settings in [base, *variants]}
    assert len(keys) == 1 + len(variants)
    assert activations.trace_key(_model("sdxl_tiny"), *base) not in keys
    # the adapter and each of its settings; adapter=none is full training's key
    adapters = [_settled("model=tiny", *extra).adapter for extra in (
        ["adapter=lora"], ["adapter=lora", "adapter.rank=4"], ["adapter=lora", "adapter.dropout=0.1"],
        ["adapter=lora", "adapter.target_modules=[conv1]"])]
    tuned = {activations.trace_key(cfg, *base, a) for a in adapters}
    assert len(tuned) == len(adapters) and not tuned & keys
    assert activations.trace_key(cfg, *base, _settled("model=tiny").adapter) == activations.trace_key(cfg, *base)


def test_a_corrupt_cache_file_is_traced_again(private_cache):
    cfg = _model("tiny")
    key = activations.trace_key(cfg, (1, 8, 8), 1, "fp32", False, "default")
    activations.cache_dir().mkdir(parents=True)
    (activations.cache_dir() / f"trace-{key}.json").write_text('{"activation_peak_bytes": 1')
    assert trace_step(cfg, (1, 8, 8), 1, "fp32", False, "default").activation_peak_bytes > 1


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError) as err:
        trace_step(_model("tiny"), (1, 8, 8), 1, "fp8", False, "default")
    assert err.value.key == "precision"


def test_flops_scale_linearly_with_batch():
    cfg = _model("sdxl_tiny")
    one, three = (trace_step(cfg, (4, 16, 16), batch, "fp32", True, "sdpa") for batch in (1, 3))
    assert three.forward_flops == 3 * one.forward_flops > 0
    assert three.backward_flops == 3 * one.backward_flops > 0


def test_flops_are_flop_counter_modes():
    """Same totals as FlopCounterMode run around forward and backward, attention included."""
    cfg, shape = _model("sdxl_tiny"), (4, 16, 16)
    trace = trace_step(cfg, shape, 2, "fp32", True, "sdpa")
    cpu_attention = (aten._scaled_dot_product_flash_attention_for_cpu,
                     aten._scaled_dot_product_flash_attention_for_cpu_backward)
    formulas = {op: FLOP_FORMULAS[op].__wrapped__ for op in cpu_attention}
    unet = activations._meta_unet(cfg, "fp32", True, "sdpa")
    with FakeTensorMode(allow_non_fake_inputs=True):
        unet.to_empty(device="cpu")
        inputs = activations._inputs(cfg, shape, 2, activations.DTYPES["fp32"])
        with FlopCounterMode(display=False, custom_mapping=formulas) as forward:
            loss = activations._loss(unet, cfg, inputs)
        with FlopCounterMode(display=False, custom_mapping=formulas) as backward:
            loss.backward()
    assert (trace.forward_flops, trace.backward_flops) == (forward.get_total_flops(), backward.get_total_flops())
    assert forward.get_flop_counts()["Global"][aten._scaled_dot_product_flash_attention_for_cpu] > 0

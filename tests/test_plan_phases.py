"""The run's phases (plan/phases.py): each phase's own peak, what earlier phases leave reserved, the run's peak;
and the run's measured timeline marks the same phases (summary.json memory.phases)."""

from __future__ import annotations

import pytest

from tests.helpers.cli import compose_cfg, config_of, preflight
from zerotune.builder.preview import phase_marks
from zerotune.plan import command_line, gpus
from zerotune.plan.command_line import platform_for
from zerotune.plan.phases import run_peak, run_phases
from zerotune.plan.predict import predict
from zerotune.rundir.plan import Phase, Plan


def plan_with_phases(*overrides: str, card: str | None = "rtx4090", phase_overrides: tuple[str, ...] = ()):
    """predict() for `overrides`, then the phases of the run `overrides + phase_overrides` describes (data=folder
    needs a real folder for its preflight: the step is predicted on synthetic data of the same shapes)."""
    gpu = gpus.lookup(card) if card else None
    cfg = compose_cfg(*overrides)
    checked = preflight(cfg, overrides=list(overrides), platform=platform_for(gpu))
    plan = predict(checked, gpu)
    phases = run_phases(config_of(*overrides, *phase_overrides), checked, gpu, plan)
    return plan, phases


def by_name(phases: list[Phase]) -> dict[str, Phase]:
    return {p.phase: p for p in phases}


def check_accounting(phases: list[Phase]) -> None:
    """Terms add up to each phase's own peak; reserved is the larger of it and what the phase before left; the
    run's peak is the largest reserved figure, and exactly one phase is marked as it."""
    for p in phases:
        assert sum(t.mib for t in p.terms) == pytest.approx(p.peak_mib, rel=1e-9), p.phase
        if p.phase != "step":  # the step's terms are predict()'s, taken as given
            assert all(t.note for t in p.terms if t.mib), p.phase  # each term says its source
        assert p.reserved_mib == pytest.approx(max(p.carried_mib, p.peak_mib))
        assert p.source
    assert phases[0].carried_mib == 0
    top = max(p.reserved_mib for p in phases)
    assert [p.run_peak for p in phases].count(True) == 1
    assert next(p for p in phases if p.run_peak).reserved_mib == top == run_peak(phases).reserved_mib


@pytest.mark.parametrize("experiment", ["sdxl_4090_128_bs8", "sdxl_4090_1024_bs8"])
def test_the_reference_rows_peak_while_loading_with_one_group(experiment):
    """ZeRO-2, bf16, optimizer offload, on the 4090, deepspeed.param_groups=1: DeepSpeed flattens the parameters
    on the GPU while their separate blocks are still held, then clones the partition there for the fp32 master:
    about three copies of the weights at once, above the step at both resolutions."""
    plan, phases = plan_with_phases(f"experiment={experiment}", "deepspeed.param_groups=1")
    check_accounting(phases)
    assert [p.phase for p in phases] == ["loading", "step"]  # synthetic data, no evaluation, no checkpoint
    loading, step = by_name(phases)["loading"], by_name(phases)["step"]
    terms = {t.term: t.mib for t in loading.terms}
    assert terms["flat_parameter_buffer"] == pytest.approx(4898.0)  # 2,567,463,684 x 2 B, rounded to 2 MiB
    assert terms["master_partition_clone"] == pytest.approx(4898.0)
    assert terms["unet_parameter_blocks"] > terms["flat_parameter_buffer"]  # one block per parameter: rounding
    assert "cublas_workspace" not in terms  # no matmul before the first step
    assert step.peak_mib == pytest.approx(plan.gpu_peak_mib) and step.terms == plan.gpu_terms
    assert run_peak(phases).phase == "loading"
    # the trainer's empty_cache() after the engine's build: only the flat buffer (and the context) carry over
    assert step.carried_mib == pytest.approx(terms["cuda_context"] + terms["flat_parameter_buffer"])


@pytest.mark.parametrize("experiment", ["sdxl_4090_128_bs8", "sdxl_4090_1024_bs8"])
def test_sixteen_groups_bring_the_loading_peak_below_the_step(experiment):
    """deepspeed.param_groups=auto (16 at ZeRO-2): one group's flat buffer and clone at a time beside the blocks,
    and only the last group's freed blocks and clone carried into the step."""
    plan, phases = plan_with_phases(f"experiment={experiment}")
    check_accounting(phases)
    loading, step = by_name(phases)["loading"], by_name(phases)["step"]
    terms = {t.term: t.mib for t in loading.terms}
    _, one = plan_with_phases(f"experiment={experiment}", "deepspeed.param_groups=1")
    blocks = {t.term: t.mib for t in by_name(one)["loading"].terms}["unet_parameter_blocks"]
    assert terms["unet_parameter_blocks"] == pytest.approx(blocks)  # the first group: every block still there
    # a sixteenth of the flat buffer and of the clone (each group rounded to 2 MiB)
    assert terms["flat_parameter_buffer"] == terms["master_partition_clone"] == pytest.approx(4898.0 / 16, abs=40)
    assert "group 1 of 16" in next(t.note for t in loading.terms if t.term == "master_partition_clone")
    assert loading.reserved_mib < step.peak_mib and run_peak(phases).phase == "step"
    assert step.carried_mib < step.peak_mib


def test_caching_appears_only_when_it_runs_on_the_gpu():
    base = ("model=sdxl_tiny", "resolution=64", "train.batch_size=2", "zero_stage=2", "data=synthetic")
    folder = ("data=folder", "data.path=/nonexistent", "data.cache_batch_size=4")
    _, on_gpu = plan_with_phases(*base, phase_overrides=folder)
    _, on_cpu = plan_with_phases(*base, phase_overrides=(*folder, "data.cache_device=cpu"))
    _, synthetic = plan_with_phases(*base)
    _, no_card = plan_with_phases(*base, card=None, phase_overrides=folder)  # auto: this CPU machine
    assert [p.phase for p in on_gpu][:2] == ["caching", "loading"]
    assert "caching" not in by_name(on_cpu) | by_name(synthetic) | by_name(no_card)
    check_accounting(on_gpu)
    caching = by_name(on_gpu)["caching"]
    terms = {t.term for t in caching.terms}
    assert {"cuda_context", "cublas_workspace", "vae_weights"} <= terms
    assert "empty_cache" in caching.source
    # release() empties the cache: loading starts from what is still alive (the context), not the encoders' pool
    assert by_name(on_gpu)["loading"].carried_mib < caching.reserved_mib


@pytest.mark.slow  # SDXL's VAE traced at 1024 px, 28 s cold; the caching phase itself is checked above
def test_sdxl_caching_at_1024_is_the_run_peak():
    """SDXL's VAE encoding 8 images of 1024 px in fp32 (FrozenEncoders) holds more than the training step."""
    _, phases = plan_with_phases("experiment=sdxl_4090_1024_bs8",
                                 phase_overrides=("data=folder", "data.path=/nonexistent"))
    check_accounting(phases)
    caching = by_name(phases)["caching"]
    terms = {t.term: t for t in caching.terms}
    assert 319.1 < terms["vae_weights"].mib < 340  # 83,653,863 fp32 parameters, one block each (rounded)
    assert "vae_encode_activations" in terms and "SDXL base 1.0" in terms["vae_weights"].note
    assert run_peak(phases).phase == "caching"


def test_zero3_holds_its_partitions_while_caching_and_gathers_for_sampling():
    _, phases = plan_with_phases("model=sdxl_tiny", "resolution=64", "train.batch_size=2", "zero_stage=3",
                                 "data=synthetic", phase_overrides=("data=folder", "data.path=/nonexistent"))
    check_accounting(phases)
    assert "unet_partitions" in {t.term for t in by_name(phases)["caching"].terms}
    # the engine's build replayed (zero3.loading): the flat partition buffer, and the build's freed blocks cached
    assert {"params", "allocator_reserve"} <= {t.term for t in by_name(phases)["loading"].terms}
    _, digits = plan_with_phases("zero_stage=3")  # the default job: digits, evaluated, a final checkpoint
    check_accounting(digits)
    assert [p.phase for p in digits] == ["loading", "step", "sampling", "export"]
    assert "zero3_gather_one_module" in {t.term for t in by_name(digits)["sampling"].terms}


def test_the_breakdown_and_the_builder_show_the_phases():
    plan, phases = plan_with_phases("experiment=sdxl_4090_128_bs8")
    text = command_line.breakdown(plan.adding(phases=phases))
    assert "the run's phases" in text and "<- the run's peak" in text and "flat_parameter_buffer" in text
    without = Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "phases"})
    assert "phases" not in without and "the run's phases" not in command_line.breakdown(without)
    marks = phase_marks(plan.adding(phases=phases))
    assert [m["phase"] for m in marks] == ["loading", "step"] and [m["run_peak"] for m in marks] == [False, True]
    assert phase_marks(without) == []


def test_a_cpu_run_records_its_phases(default_job_run):
    _, summary = default_job_run
    phases = summary["memory"]["phases"]
    assert [p["phase"] for p in phases] == ["loading", "step", "sampling"]
    for before, after in zip(phases, phases[1:], strict=False):
        assert before["end"] <= after["start"]
    for p in phases:
        assert p["start"] <= p["end"]
        assert p["gpu_max_reserved_mib"] is None and p["gpu_max_allocated_mib"] is None  # no CUDA: unmeasured
        assert p["host_peak_rss_mib"] > 0  # sampled at the phase's start and end at least


def test_lora_at_zero3_gathers_its_targets_before_caching():
    """peft wraps LoRA's targets while they are gathered whole (models/adapter.py gathered_targets): a phase of its
    own at ZeRO-3, the targets' own weights in the run's dtype on top of the partitions; none without an adapter
    or below ZeRO-3."""
    import torch
    from accelerate import init_empty_weights

    from zerotune.models import adapter, build_network

    tiny = ("model=sdxl_tiny", "resolution.size=64", "train.batch_size=2", "precision=bf16")
    cfg = config_of(*tiny, "adapter=lora")
    with init_empty_weights():
        unet = build_network(cfg.model)
        want = sum(p.numel() for m in adapter.targeted_modules(unet, cfg.adapter) for p in m.parameters(recurse=False))
    assert want > 0 and all(isinstance(m, torch.nn.Linear) for m in adapter.targeted_modules(unet, cfg.adapter))
    _, phases = plan_with_phases(*tiny, "adapter=lora", "zero_stage=3")
    check_accounting(phases)
    assert [p.phase for p in phases][0] == "adapter_injection"
    gathered = next(t for t in by_name(phases)["adapter_injection"].terms if t.term == "adapter_targets_gathered")
    assert gathered.mib * 2**20 == want * 2
    for overrides in (("zero_stage=2", "adapter=lora"), ("zero_stage=3", "adapter=none")):
        _, phases = plan_with_phases(*tiny, *overrides)
        assert "adapter_injection" not in by_name(phases)


# --- validation passes: the sampling phase of a text model with prompts ---------------------------------------

PROMPTS = 'validation.prompts=["a photo of a dog"]'


@pytest.mark.parametrize("stage", [2, 3])
def test_a_validation_pass_is_the_sampling_phase(stage, tmp_path):
    from zerotune.models import model_stats, text_encoders
    from zerotune.plan import allocator, encoders

    (tmp_path / "vae").mkdir()  # no config.json: the built-in sdxl_tiny architectures describe the components
    overrides = ("model=sdxl_tiny", "resolution.size=64", "train.batch_size=2", "precision=bf16",
                 f"model.components={tmp_path}", f"zero_stage={stage}")
    plan, phases = plan_with_phases(*overrides, card="h100", phase_overrides=(PROMPTS,))
    check_accounting(phases)
    sampling = by_name(phases)["sampling"]
    terms = {t.term: t.mib for t in sampling.terms}
    # The VAE in bf16 and, at ZeRO-3 only, the U-Net gathered whole in bf16: one allocator block per parameter.
    cfg = config_of(*overrides)
    vae = encoders._meta_models(text_encoders.SDXL_TINY, {"vae": "AutoencoderKL"})["vae"]
    assert terms["vae_weights"] == allocator.reserved_bytes([p.numel() * 2 for p in vae.parameters()]) / 2**20
    assert ("unet_gathered_for_sampling" in terms) == (stage == 3)
    if stage == 3:
        numels = model_stats(cfg.model, cfg.adapter).param_numels
        assert terms["unet_gathered_for_sampling"] == allocator.reserved_bytes([n * 2 for n in numels]) / 2**20
    assert terms["sampling_activations"] > 0 and "64x64" in next(
        t.note for t in sampling.terms if t.term == "sampling_activations")
    # Without prompts there is no sampling phase for a text model.
    assert "sampling" not in by_name(plan_with_phases(*overrides, card="h100")[1])


@pytest.mark.parametrize("size", [64, 256])
def test_the_sampling_trace_matches_the_pass_run_on_this_cpu(size):
    """trace_sampling (fake tensors) against the same pipeline call run for real here, through torch.profiler."""
    from zerotune.models import text_encoders
    from zerotune.plan import encoders

    cfg = config_of("model=sdxl_tiny")
    archs, _ = text_encoders.configs(cfg.model)
    hw = (size // 4, size // 4)
    traced = encoders.trace_sampling(archs, cfg.model, None, hw, "fp32")
    predicted = max(traced["unet_peak"], traced["vae_decode_peak"])
    measured = encoders.measure_sampling_on_cpu(archs, cfg.model, hw)["between_ops"]
    assert 0.95 < measured / predicted < 1.15, (measured, predicted)  # 1.06 at 64 px, 1.03 at 256 and 512


@pytest.mark.parametrize("model,encoders_", [("flux_tiny", ("CLIPTextModel", "T5EncoderModel")),
                                             ("sd3_tiny", ("CLIPTextModelWithProjection",) * 2 + ("T5EncoderModel",))])
def test_a_transformers_caching_and_validation_are_planned(model, encoders_, tmp_path):
    """FLUX.1's and SD3's frozen encoders (CLIP and T5, fp32) while caching, their transformer gathered for
    sampling at ZeRO-3, from the built-in architectures of their tiny components."""
    import transformers

    from zerotune.models import text_encoders
    from zerotune.plan import allocator

    (tmp_path / "vae").mkdir()  # no config.json: the built-in architectures describe the components
    overrides = (f"model={model}", "resolution.size=64", "train.batch_size=2", f"model.components={tmp_path}",
                 "zero_stage=3")
    _, phases = plan_with_phases(*overrides, card="h100",
                                 phase_overrides=(PROMPTS, "data=folder", "data.path=/nonexistent"))
    check_accounting(phases)
    assert [p.phase for p in phases][:4] == ["caching", "loading", "step", "sampling"]
    archs = text_encoders.BUILTIN[model][0]
    built = []
    for arch, cls in zip((a for n, a in archs.items() if n != "vae"), encoders_, strict=True):
        config = (transformers.T5Config if cls == "T5EncoderModel" else transformers.CLIPTextConfig)(**arch)
        built.append(allocator.reserved_bytes([p.numel() * 4 for p in getattr(transformers, cls)(config).parameters()]))
    caching = {t.term: t.mib for t in by_name(phases)["caching"].terms}
    if "text_encoder_weights" in caching:  # the larger of the VAE's and the text's moments
        assert caching["text_encoder_weights"] == pytest.approx(sum(built) / 2**20)
    sampling = {t.term for t in by_name(phases)["sampling"].terms}
    assert {"unet_gathered_for_sampling", "vae_weights", "sampling_activations"} <= sampling


@pytest.mark.slow  # FLUX.1-dev's 11.9B transformer traced cold: about a minute
def test_flux_caches_with_t5_xxl_and_clip_l_in_fp32(tmp_path):
    (tmp_path / "vae").mkdir()
    _, phases = plan_with_phases("model=flux", "resolution.size=1024", "train.batch_size=1", "precision=bf16",
                                 "zero_stage=3", "offload=cpu", f"model.components={tmp_path}", card="h100",
                                 phase_overrides=(PROMPTS, "data=folder", "data.path=/nonexistent",
                                                  "data.cache_batch_size=1"))
    check_accounting(phases)
    caching = {t.term: t.mib for t in by_name(phases)["caching"].terms}
    # T5 v1.1 XXL's encoder (4,762,310,656 parameters) and CLIP-L's text model (123,060,480), 4 bytes each
    assert 18_636 <= caching["text_encoder_weights"] < 18_700

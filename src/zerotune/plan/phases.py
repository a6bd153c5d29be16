"""The whole run, not only the training step: what nvidia-smi shows (the CUDA context and what torch's caching
allocator has reserved) in each phase, in run order (train/run.py, train/trainer.py Trainer._prepare): adapter
injection, caching, loading, step, sampling, export."""

from __future__ import annotations

from dataclasses import replace

from zerotune.config.schema import DTYPE_BYTES, MIB, Config
from zerotune.data.prompts import check_validation, enabled
from zerotune.models import backbones, text_encoders
from zerotune.plan import allocator, encoders
from zerotune.plan.gpus import GPU
from zerotune.plan.model_states import rules_for
from zerotune.plan.resolve import ResolvedRun
from zerotune.plan.rules import state_mib, term, zero_stage
from zerotune.rundir.plan import PERSISTENT, Phase, Plan, Term, mib_of

_BASE = ("cuda_context", "cublas_workspace")


def run_phases(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, plan: Plan) -> list[Phase]:
    """The run's phases in run order (rundir.plan.Phase); `plan`: predict.predict's step."""
    base = [t for t in plan.gpu_terms if t.term in _BASE]
    caching = _caching(cfg, resolved, gpu, plan, base)
    # cuBLAS makes its workspace at the first matmul: the encoders' when caching ran, else the step's.
    before = base if caching else [t for t in base if t.term == "cuda_context"]
    # loading: DeepSpeed's engine and ZeRO optimizer take the U-Net, each stage's own rule (stage0, zero12, zero3)
    found = [_adapter_injection(cfg, resolved, plan, before), caching,
             rules_for(zero_stage(resolved)).loading(cfg, resolved, gpu, plan, before), _step(plan),
             _sampling(cfg, resolved, plan, base), _export(cfg, plan, base)]
    return _carry([p for p in found if p is not None])


def run_peak(phases: list[Phase]) -> Phase:
    """The phase whose reserved figure is the run's largest."""
    return max(phases, key=lambda p: p.reserved_mib)


# Without empty_cache a phase's pool is at least the larger of what earlier phases left reserved and its own peak
# (packing taken as perfect: a lower bound); after an empty_cache only the live blocks carry over.
def _carry(phases: list[Phase]) -> list[Phase]:
    carried, out = 0.0, []
    for p in phases:
        reserved = max(carried, p.peak_mib)
        out.append(replace(p, carried_mib=carried, reserved_mib=reserved))
        # an empty_cache at the phase's end: only live blocks stay reserved
        carried = reserved if p.end_live_mib is None else p.end_live_mib
    top = run_peak(out).phase if out else None
    return [replace(p, run_peak=p.phase == top) for p in out]


def _caching(cfg: Config, resolved: ResolvedRun, gpu: GPU | None, plan: Plan, base: list[Term]) -> Phase | None:
    """FrozenEncoders (data/components.py) on the GPU: the VAE in fp32 encodes one batch of images, then both
    text encoders (fp32, the VAE still loaded) one batch of captions; release() ends with empty_cache."""
    device = cfg.data.cache_device
    if cfg.data.name != "folder" or not (device.startswith("cuda") or (device == "auto" and gpu is not None)):
        return None
    found = text_encoders.configs(cfg.model)
    if found is None:
        return None
    archs, where = found
    size, batch = cfg.resolution.size, cfg.data.cache_batch_size
    images = batch * (2 if cfg.data.random_flip else 1)  # both orientations of each image in one encode call
    traced = encoders.trace_encoders(archs, backbones.backbone_of(cfg.model).components(), (size, size), images,
                                     batch, encoders.text_lengths(cfg.model))
    weights = {n: allocator.reserved_bytes(sizes) for n, sizes in traced["params"].items()}
    resident = _zero3_resident(resolved, plan)
    vae = [term("vae_weights", weights["vae"], f"fp32, one block per parameter ({where})"),
           term("vae_encode_activations", traced["vae_peak"], f"fake-tensor trace: {images} images of {size}x{size}, "
                "fp32 (latent_cache._build_latents, FrozenEncoders.encode_images)")]
    text_weights = sum(b for name, b in weights.items() if name.startswith("text_encoder"))
    text = [vae[0], term("text_encoder_weights", text_weights,
                         f"every text encoder, fp32, one block per parameter ({where}); the VAE stays loaded"),
            term("text_encode_activations", traced["text_peak"], f"fake-tensor trace: {batch} captions, "
                 "all hidden states (FrozenEncoders.encode_text)")]
    top = max((vae, text), key=mib_of)
    terms = [*base, *resident, *top]
    return Phase("caching", mib_of(terms), tuple(terms),
                 "data/prepare.py prepare_folder_data -> data/latent_cache.py build_cache; "
                 "data/components.py FrozenEncoders.release calls torch.cuda.empty_cache() (line 198)",
                 end_live_mib=mib_of([*base, *resident]))


def _zero3_resident(resolved: ResolvedRun, plan: Plan) -> list[Term]:
    """At ZeRO-3 the U-Net is built under zero.Init before the data: its partitions are on the GPU already."""
    if zero_stage(resolved) != 3:
        return []
    mib = state_mib(plan, "params") + state_mib(plan, "params_persistent")
    return [term("unet_partitions", mib * MIB, "built under zero.Init before build_loader (trainer.py _prepare)")]


def _adapter_injection(cfg: Config, resolved: ResolvedRun, plan: Plan, base: list[Term]) -> Phase | None:
    """ZeRO-3 with an adapter: peft wraps its targets gathered whole in the run's dtype (models/adapter.py
    gathered_targets); freed after, reserved until DeepSpeed's engine empties the cache."""
    resident = _zero3_resident(resolved, plan)
    targets = resolved.model_stats.adapter_target_numel
    if not resident or not targets:
        return None
    terms = [*base, *resident, term("adapter_targets_gathered", targets * DTYPE_BYTES[cfg.precision.name],
                                    "deepspeed.zero.GatheredParameters over peft's targets (transient)")]
    return Phase("adapter_injection", mib_of(terms), tuple(terms),
                 "models/adapter.py add_adapter under gathered_targets (trainer.py _prepare)")


def _step(plan: Plan) -> Phase:
    """What the step holds throughout and at its largest moment (plan/predict.py): its terms add up."""
    moment = plan.step_peak_moment
    return Phase("step", plan.gpu_peak_mib or 0.0, tuple(plan.terms_at_peak()),
                 f"the step's prediction (plan/predict.py gpu_terms), at its largest moment: {moment}")


def _live_states(plan: Plan) -> list[Term]:
    """What stays allocated after a step: the model states and the parameters' rounding (activations and the
    step's transients are freed, their blocks reserved)."""
    keep = ("params", "grads", "master_weights", "optimizer_states", "params_persistent", "allocator_rounding")
    return [t for t in plan.gpu_terms if t.term in keep and t.held_in == PERSISTENT]


def _sampling(cfg: Config, resolved: ResolvedRun, plan: Plan, base: list[Term]) -> Phase | None:
    """The run's sampling: validation passes (text models with prompts), or the digits' evaluation."""
    found = validation_pass_terms(cfg, resolved)
    if found is None:
        return _digits_sampling(cfg, resolved, plan, base)
    return _validation(found, plan, base)


def _validation(found: tuple[list[Term], str], plan: Plan, base: list[Term]) -> Phase:
    """train/validation.py, at its largest prompt: what training holds after a step, and what the pass adds
    (validation_pass_terms). The pass ends with torch.cuda.empty_cache()."""
    added, source = found
    live = [*base, *_live_states(plan)]
    terms = [*live, *added]
    return Phase("sampling", mib_of(terms), tuple(terms),
                 f"{source}; Validator._vae_off_device calls torch.cuda.empty_cache()", end_live_mib=mib_of(live))


def validation_pass_terms(cfg: Config, resolved: ResolvedRun) -> tuple[list[Term], str] | None:
    """What a validation pass adds to what training holds, on any device: the U-Net gathered whole at ZeRO-3, the
    VAE in the training dtype, and the larger of one guided U-Net call and the VAE's decode (fake-tensor traces;
    no text encoder: the latent cache holds the embeddings). None without prompts or a VAE architecture."""
    if not enabled(cfg) or cfg.model.conditioning == "class":
        return None
    found = text_encoders.configs(cfg.model)
    if found is None:
        return None
    archs, where = found
    prompts = check_validation(cfg)
    largest = max(prompts, key=lambda p: p.width * p.height)
    scale, precision = cfg.model.vae_scale_factor, cfg.precision.name
    hw = (largest.height // scale, largest.width // scale)
    traced = encoders.trace_sampling(archs, cfg.model, cfg.adapter, hw, precision)
    terms: list[Term] = []
    if zero_stage(resolved) == 3:
        sizes = [n * DTYPE_BYTES[precision] for n in resolved.model_stats.param_numels]
        terms.append(term("unet_gathered_for_sampling", allocator.reserved_bytes(sizes),
                          "every parameter whole in the training dtype (deepspeed.zero.GatheredParameters)"))
    terms += [term("vae_weights", allocator.reserved_bytes(traced["vae_params"]), f"{precision}, one block per "
                   f"parameter ({where}); on the device for the pass only"),
              term("sampling_activations", max(traced["unet_peak"], traced["vae_decode_peak"]),
                   f"fake-tensor trace at {largest.width}x{largest.height}: one network call (batch "
                   f"{backbones.backbone_of(cfg.model).sampling_rows}) "
                   f"{traced['unet_peak'] / MIB:,.1f} MiB, the VAE's decode {traced['vae_decode_peak'] / MIB:,.1f} MiB")]
    return terms, f"train/validation.py: {len(prompts)} prompts, one at a time, {largest.steps} steps"


def _digits_sampling(cfg: Config, resolved: ResolvedRun, plan: Plan, base: list[Term]) -> Phase | None:
    """train/evaluate.py evaluate_digits: full_state_dict (at ZeRO-3 one module's own parameters gathered at a
    time) copied to the host; the sampling U-Net is built and run on the CPU."""
    if not (cfg.evaluate.enabled and cfg.model.conditioning == "class" and cfg.data.name == "digits"):
        return None
    terms = [*base, *_live_states(plan)]
    if zero_stage(resolved) == 3:
        numel = encoders.largest_module_numel(cfg.model, cfg.adapter)
        elem = 4 if cfg.precision.name == "fp32" else 2
        terms.append(term("zero3_gather_one_module", allocator.reserved_bytes([numel * elem]),
                          f"the largest module's own parameters whole ({numel:,} elements), "
                          "GatheredParameters(module.parameters(recurse=False))"))
    return Phase("sampling", mib_of(terms), tuple(terms),
                 f"train/evaluate.py: {cfg.evaluate.per_class * 10} samples x 2 (guidance) at "
                 f"{cfg.resolution.size} px, {cfg.evaluate.steps} steps, on the CPU")


def _export(cfg: Config, plan: Plan, base: list[Term]) -> Phase | None:
    """Checkpoint saves write each rank's partitions as they are (no new GPU blocks); `zerotune export`
    consolidates them on the CPU in its own process. None when the run saves no checkpoint."""
    if not (cfg.checkpoint.final or int(cfg.checkpoint.every_n_steps or 0) > 0):
        return None
    terms = [*base, *_live_states(plan)]
    return Phase("export", mib_of(terms), tuple(terms),
                 "rundir/checkpoint_io.py save (in the run); export.py runs on the CPU, "
                 "no CUDA context: 0 MiB on the GPU in its own process")

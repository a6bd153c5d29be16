"""What the run phases (phases.py) need beyond the step: the frozen encoders of data=folder's caching
(FrozenEncoders, fp32), a validation pass and the U-Net's largest module, as parameter sizes and inference
activation peaks traced on fake tensors (no weights, no GPU) and cached under <cache>/plan/."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerotune.config import files
from zerotune.config.schema import Adapter, Model

if TYPE_CHECKING:  # step_tracker imports torch's MemTracker (~1 s): only where a trace runs
    from zerotune.plan.step_tracker import StepTracker

FORMAT = 2  # bumped when a trace changes what it counts (2: T5 counts its tied embedding once)
_CACHE: dict[str, dict] = {}
def text_lengths(model_cfg: Model) -> dict[str, int]:
    """{encoder: tokens per caption} as the backbone's encode_text tokenizes: CLIP model.text_seq_len for a U-Net;
    a transformer's CLIP its tokenizer's 77 (SD3: model.clip_tokens), its T5 the rest of the condition."""
    from zerotune.models.backbones import backbone_of, is_transformer

    components = backbone_of(model_cfg).components()
    clip = int(model_cfg.clip_tokens or 77) if is_transformer(model_cfg) else int(model_cfg.text_seq_len)
    t5 = int(model_cfg.text_seq_len) - int(model_cfg.clip_tokens)
    return {name: t5 if cls == "T5EncoderModel" else clip for name, cls in components.items()
            if name.startswith("text_encoder")}


def trace_encoders(archs: dict, classes: dict[str, str], image_hw: tuple[int, int], image_batch: int,
                   text_batch: int, lengths: dict[str, int]) -> dict:
    """{"params": {name: [bytes per parameter tensor, fp32]}, "vae_peak": B, "text_peak": B, "seconds"}: the
    activation peaks (inputs, outputs and temporaries beyond the parameters) of one cache batch. `classes`: the
    backbone's components; `lengths`: text_lengths()."""
    what = [archs, classes, list(image_hw), image_batch, text_batch, lengths, torch.__version__, FORMAT]
    return _cached("encoders-", what, lambda: _trace(archs, classes, image_hw, image_batch, text_batch, lengths))


def _cached(prefix: str, what: list, make: Callable[[], dict]) -> dict:
    """`make()`'s answer for `what`, from this process, else <cache>/plan/<prefix><hash of what>.json, else made
    and written there."""
    key = prefix + hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if key not in _CACHE:
        file = files.cache_dir("plan") / f"{key}.json"
        found = files.read_json(file)
        if found is None:
            found = make()
            files.write_cached_json(file, found)
        _CACHE[key] = found
    return _CACHE[key]


def _meta_models(archs: dict, classes: dict[str, str]) -> dict:
    """The VAE and text encoders on the meta device, each of its component's class."""
    import transformers
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    def text(cls_name: str, fields: dict) -> torch.nn.Module:
        config_class = transformers.T5Config if cls_name == "T5EncoderModel" else transformers.CLIPTextConfig
        known = config_class().to_dict()
        return getattr(transformers, cls_name)(config_class(**{k: v for k, v in fields.items() if k in known}))

    with init_empty_weights():
        vae = AutoencoderKL.from_config({k: v for k, v in archs["vae"].items() if k != "force_upcast"})
        models = {"vae": vae.eval(), **{name: text(cls, archs[name]).eval() for name, cls in classes.items()
                                        if name.startswith("text_encoder")}}
    for model in models.values():  # init_empty_weights unties T5's shared token embedding from its encoder's
        getattr(model, "tie_weights", lambda: None)()
    return models


def _trace(archs: dict, classes: dict[str, str], image_hw: tuple[int, int], image_batch: int, text_batch: int,
           lengths: dict[str, int]) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerotune.plan.step_tracker import StepTracker

    start = time.perf_counter()
    models = _meta_models(archs, classes)
    params = {name: [p.numel() * 4 for p in m.parameters()] for name, m in models.items()}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        for m in models.values():
            m.to_empty(device="cpu")
        vae_peak = _peak(StepTracker(), [models["vae"]], lambda: _encode_images(models["vae"], image_hw, image_batch))
        text_peak = _peak(StepTracker(), list(models.values()),
                          lambda: _encode_text(models, classes, text_batch, lengths))
    return {"params": params, "vae_peak": vae_peak, "text_peak": text_peak,
            "seconds": round(time.perf_counter() - start, 3)}


def _peak(tracker: StepTracker, modules: list[torch.nn.Module], run: Callable[[], object]) -> int:
    for m in modules:
        tracker.track_external(m)
    with tracker:
        run()
    return int(tracker.activation_peak)


def _encode_images(vae: Any, image_hw: tuple[int, int], batch: int) -> torch.Tensor:
    """FrozenEncoders.encode_images: the posterior's mean, shifted and scaled, then copied to the host. `vae`:
    diffusers' AutoencoderKL (Any: its decorated `encode` is opaque to a type checker)."""
    pixels = torch.randn(batch, 3, *image_hw)
    latents = vae.encode(pixels).latent_dist.mean
    return (latents - 0.0) * 0.13025


def _encode_text(models: dict, classes: dict[str, str], batch: int, lengths: dict[str, int]) -> list[torch.Tensor]:
    """The backbones' encode_text, encoder after encoder in the pipeline's order, each one's outputs alive while the
    next runs: a CLIP with all its hidden states where the condition joins two CLIPs' (SDXL, SD3; the
    penultimate's kept), else its last states (SD 1.x / 2.x) or pooled output (FLUX.1); T5 its last states."""
    clips = sum(1 for name, cls in classes.items() if name.startswith("text_encoder") and cls.startswith("CLIP"))
    kept = []
    for name in (n for n in classes if n.startswith("text_encoder")):
        enc = models[name]
        ids = torch.randint(0, int(enc.config.vocab_size), (batch, lengths[name]))
        if classes[name].startswith("CLIP") and clips > 1:
            out = enc(ids, output_hidden_states=True)
            kept += [out.hidden_states[-2], out[0]]
        else:
            kept.append(enc(ids)[0])
    return kept


def largest_module_numel(model_cfg: Model, adapter_cfg: Adapter | None = None) -> int:
    """The most parameters one module of the engine's (the U-Net's, or a trained text encoder's: its token
    embedding) holds itself (recurse=False): what ZeRO-3 gathers whole at once when zero.Init partitions a module
    as it is built, and when a 16-bit state dict is consolidated module by module."""
    from zerotune.models import adapter, trained_encoder_archs, unet_config
    from zerotune.plan.activations import _meta_trained

    def count() -> dict:
        module = _meta_trained(model_cfg, "fp32", False, str(model_cfg.attention), adapter_cfg)
        return {"numel": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())}

    what = [unet_config(model_cfg), adapter.settings(adapter_cfg), torch.__version__, FORMAT]
    trained = trained_encoder_archs(model_cfg)
    if trained:  # absent otherwise: earlier cache entries keep their keys
        what.append(trained)
    return int(_cached("modules-", what, count)["numel"])


def trace_sampling(archs: dict, model_cfg: Model, adapter_cfg: Adapter | None, latent_hw: tuple[int, int],
                   precision: str) -> dict:
    """A validation pass (train/validation.py) on fake tensors: {"vae_params": [bytes per parameter, in the
    training dtype], "unet_peak": B (one step of the network, no grad: the prompt and its negative as a batch of 2
    where it is guided by them, FLUX.1's prompt alone),
    "vae_decode_peak": B (one latent decoded), "seconds"}."""
    from zerotune.models import adapter, unet_config

    what = [archs["vae"], unet_config(model_cfg), adapter.settings(adapter_cfg), list(latent_hw),
            precision, str(model_cfg.attention), int(model_cfg.text_seq_len), torch.__version__, FORMAT]
    return _cached("sampling-", what, lambda: _trace_sampling(archs, model_cfg, adapter_cfg, latent_hw, precision))


def _trace_sampling(archs: dict, model_cfg: Model, adapter_cfg: Adapter | None, latent_hw: tuple[int, int],
                    precision: str) -> dict:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerotune.models.backbones import backbone_of
    from zerotune.plan.activations import DTYPES, _inputs, _meta_unet
    from zerotune.plan.step_tracker import StepTracker

    start, dtype, net = time.perf_counter(), DTYPES[precision], backbone_of(model_cfg)
    unet = _meta_unet(model_cfg, precision, False, str(model_cfg.attention), adapter_cfg).eval()
    with init_empty_weights():
        vae = AutoencoderKL.from_config({k: v for k, v in archs["vae"].items() if k != "force_upcast"})
        torch.nn.Module.to(vae, dtype)  # nn.Module's: diffusers' own `to` warns about fp32 modules
    vae_params = [p.numel() * p.element_size() for p in vae.parameters()]
    channels = int(archs["vae"].get("latent_channels", 4))
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        unet.to_empty(device="cpu")
        vae.to_empty(device="cpu")
        inputs = _inputs(model_cfg, (channels, *latent_hw), net.sampling_rows, dtype)
        unet_peak = _peak(StepTracker(), [unet], lambda: net.predict(unet, inputs["x0"], inputs["timesteps"],
                                                                     inputs["cond"], 3.5))
        latents = torch.randn(1, channels, *latent_hw, dtype=dtype)
        decode_peak = _peak(StepTracker(), [vae], lambda: vae.decode(latents).sample)
    return {"vae_params": vae_params, "unet_peak": unet_peak, "vae_decode_peak": decode_peak,
            "seconds": round(time.perf_counter() - start, 3)}


def measure_sampling_on_cpu(archs: dict, model_cfg: Model, latent_hw: tuple[int, int], steps: int = 2) -> dict:
    """The check on trace_sampling: a validation pass's pipeline call run for real on this CPU with random weights,
    as train/validation.py calls it. {"between_ops", "with_workspaces"}: bytes held beyond the weights, measured
    as activations.measure_step_on_cpu measures them."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline
    from torch.profiler import ProfilerActivity, profile

    from zerotune.config.schema import Diffusion
    from zerotune.models import build_network, unet_config
    from zerotune.models.diffusion import make_sampler, noise_scheduler
    from zerotune.plan.activations import _peaks

    torch.manual_seed(0)
    unet = build_network(model_cfg).eval()
    vae = AutoencoderKL.from_config({k: v for k, v in archs["vae"].items() if k != "force_upcast"}).eval()
    schedule = dict(noise_scheduler(Diffusion()).config)  # the training schedule's defaults
    sampler = make_sampler(schedule, str(model_cfg.prediction_type), pixel_space=False)
    config = unet_config(model_cfg)
    states = torch.randn(1, int(model_cfg.text_seq_len), int(config["cross_attention_dim"]))
    embeds: dict[str, torch.Tensor] = {"prompt_embeds": states}
    if model_cfg.conditioning == "text":  # as train/validation.py: the zeros null condition as the negative
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=sampler,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        embeds["negative_prompt_embeds"] = torch.zeros_like(states)
    else:
        pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                         tokenizer_2=None, unet=unet, scheduler=sampler, add_watermarker=False)
        pooled = int(config["projection_class_embeddings_input_dim"]) - 6 * int(config["addition_time_embed_dim"])
        embeds["pooled_prompt_embeds"] = torch.randn(1, pooled)
    pipe.set_progress_bar_config(disable=True)
    scale = 2 ** (len(archs["vae"]["block_out_channels"]) - 1)  # pixels per latent
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.no_grad():
        pipe(**embeds, height=latent_hw[0] * scale,
             width=latent_hw[1] * scale, num_inference_steps=steps, guidance_scale=5.0,
             generator=torch.Generator().manual_seed(0), output_type="pt")
    peaks = _peaks(prof.profiler.kineto_results.events())
    return {"between_ops": peaks.between_ops, "with_workspaces": peaks.with_workspaces}

"""The frozen encoders of data=folder's caching (data/components.py FrozenEncoders) and the U-Net's module sizes,
as the run phases need them (phases.py): parameter sizes and inference activation peaks, traced on fake tensors
(no weights, no GPU), cached like activations.trace_step's traces (<cache>/plan/encoders-<key>.json).

What is traced is what FrozenEncoders does on its device, in fp32:
- latents: `vae.encode(pixels).latent_dist.mean`, scaled, on a batch of images at the bucket's size;
- text: text_encoder then text_encoder_2 with output_hidden_states=True (the first's outputs stay referenced
  while the second runs: `out` is rebound only when it returns), their penultimate states concatenated;
  SD 1.x / 2.x (`conditioning: text`): the one text_encoder's last hidden states.
The VAE stays on the device while the text encoders run (both are dropped by release(), at the end).

Architectures: the components' own config.json when model.components (or model.vae, ...) names local folders;
otherwise the published configs for model=sdxl (SDXL base 1.0), sd15 and sd21, and
tests/helpers/tiny_components.py's for model=sdxl_tiny and sd15_tiny (their conf/model/ files describe the same sets).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotune import files
from zerotune.schema import Adapter, Model

if TYPE_CHECKING:  # step_tracker imports torch's MemTracker (~1 s): only where a trace runs
    from zerotune.plan.step_tracker import StepTracker

FORMAT = 1
_CACHE: dict[str, dict] = {}
_CLIP = {"vocab_size": 49408, "max_position_embeddings": 77}
# stabilityai/stable-diffusion-xl-base-1.0: vae/config.json, text_encoder/config.json (CLIP ViT-L/14's text
# model), text_encoder_2/config.json (OpenCLIP ViT-bigG/14's text model, with its projection).
SDXL = {
    "vae": {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
            "layers_per_block": 2, "latent_channels": 4, "norm_num_groups": 32, "sample_size": 1024,
            "scaling_factor": 0.13025},
    "text_encoder": {**_CLIP, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                     "num_attention_heads": 12, "hidden_act": "quick_gelu", "projection_dim": 768},
    "text_encoder_2": {**_CLIP, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                       "num_attention_heads": 20, "hidden_act": "gelu", "projection_dim": 1280},
}
_TINY_TEXT = {"vocab_size": 520, "max_position_embeddings": 77, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 37}
SDXL_TINY = {
    "vae": {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 3,
            "up_block_types": ["UpDecoderBlock2D"] * 3, "block_out_channels": [8, 16, 16], "layers_per_block": 1,
            "latent_channels": 4, "norm_num_groups": 8, "sample_size": 64},
    "text_encoder": {**_TINY_TEXT, "hidden_size": 32},
    "text_encoder_2": {**_TINY_TEXT, "hidden_size": 64, "projection_dim": 64},
}
# runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-2-1: vae/config.json (SDXL's layout, SD's
# scaling factor) and text_encoder/config.json (CLIP ViT-L/14; OpenCLIP ViT-H/14 with its last layer dropped).
_SD_VAE = {**SDXL["vae"], "sample_size": 512, "scaling_factor": 0.18215}
SD15 = {"vae": _SD_VAE, "text_encoder": SDXL["text_encoder"]}
SD21 = {"vae": {**_SD_VAE, "sample_size": 768},
        "text_encoder": {**_CLIP, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 23,
                         "num_attention_heads": 16, "hidden_act": "gelu", "projection_dim": 512}}
SD15_TINY = {"vae": SDXL_TINY["vae"], "text_encoder": SDXL_TINY["text_encoder"]}
BUILTIN: dict[str, tuple[dict, str]] = {
    "sdxl": (SDXL, "SDXL base 1.0's vae/, text_encoder/, text_encoder_2/ config.json"),
    "sdxl_tiny": (SDXL_TINY, "tests/helpers/tiny_components.py (conf/model/sdxl_tiny.yaml)"),
    "sd15": (SD15, "Stable Diffusion 1.5's vae/, text_encoder/ config.json"),
    "sd21": (SD21, "Stable Diffusion 2.1's vae/, text_encoder/ config.json"),
    "sd15_tiny": (SD15_TINY, "tests/helpers/tiny_components.py (conf/model/sd15_tiny.yaml)")}
_MODEL_KEYS = ("vae", "text_encoder", "text_encoder_2")


def configs(model_cfg: Model) -> tuple[dict, str] | None:
    """The three architectures and where they come from; None when neither local folders nor a built-in set
    describe them."""
    base = model_cfg.components
    found = {}
    for name in _MODEL_KEYS if model_cfg.conditioning == "text_time" else _MODEL_KEYS[:2]:
        own = getattr(model_cfg, name) or (Path(str(base)) / name if base else None)
        file = Path(str(own)).expanduser() / "config.json" if own else None
        if file is None or not file.is_file():
            break
        found[name] = {k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")}
    else:
        return found, "the components' own config.json (model.components / model.vae, ...)"
    return BUILTIN.get(str(model_cfg.name))


def trace_encoders(archs: dict, image_hw: tuple[int, int], image_batch: int, text_batch: int, seq_len: int) -> dict:
    """{"params": {name: [bytes per parameter tensor, fp32]}, "vae_peak": B, "text_peak": B, "seconds"}: the
    activation peaks (inputs, outputs and temporaries beyond the parameters) of one cache batch."""
    what = [archs, list(image_hw), image_batch, text_batch, seq_len, torch.__version__, FORMAT]
    return _cached("encoders-", what, lambda: _trace(archs, image_hw, image_batch, text_batch, seq_len))


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


def _meta_models(archs: dict) -> dict:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    def text(cls: type, fields: dict) -> torch.nn.Module:
        return cls(CLIPTextConfig(**{k: v for k, v in fields.items() if k in CLIPTextConfig().to_dict()}))

    with init_empty_weights():
        vae = AutoencoderKL.from_config({k: v for k, v in archs["vae"].items() if k != "force_upcast"})
        models = {"vae": vae.eval(), "text_encoder": text(CLIPTextModel, archs["text_encoder"]).eval()}
        if "text_encoder_2" in archs:  # SDXL
            models["text_encoder_2"] = text(CLIPTextModelWithProjection, archs["text_encoder_2"]).eval()
        return models


def _trace(archs: dict, image_hw: tuple[int, int], image_batch: int, text_batch: int, seq_len: int) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerotune.plan.step_tracker import StepTracker

    start = time.perf_counter()
    models = _meta_models(archs)
    params = {name: [p.numel() * 4 for p in m.parameters()] for name, m in models.items()}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        for m in models.values():
            m.to_empty(device="cpu")
        vae_peak = _peak(StepTracker(), [models["vae"]], lambda: _encode_images(models["vae"], image_hw, image_batch))
        text_peak = _peak(StepTracker(), list(models.values()),
                          lambda: _encode_text(models, text_batch, seq_len))
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


def _encode_text(models: dict, batch: int, seq_len: int) -> torch.Tensor:
    """FrozenEncoders.encode_text: both encoders with all hidden states, the first's output alive meanwhile;
    SD 1.x / 2.x: the one encoder's last hidden states."""
    if "text_encoder_2" not in models:
        enc = models["text_encoder"]
        return enc(torch.randint(0, int(enc.config.vocab_size), (batch, seq_len)))[0]
    states, out = [], None
    for name in ("text_encoder", "text_encoder_2"):
        enc = models[name]
        ids = torch.randint(0, int(enc.config.vocab_size), (batch, seq_len))
        out = enc(ids, output_hidden_states=True)
        states.append(out.hidden_states[-2])
    return torch.cat(states, dim=-1)


def largest_module_numel(model_cfg: Model, adapter_cfg: Adapter | None = None) -> int:
    """The most parameters one U-Net module holds itself (recurse=False): what ZeRO-3 gathers whole at once when
    zero.Init partitions a module as it is built, and when a 16-bit state dict is consolidated module by module."""
    from zerotune.models import adapter, unet_config
    from zerotune.plan.activations import _meta_unet

    def count() -> dict:
        unet = _meta_unet(model_cfg, "fp32", False, str(model_cfg.attention), adapter_cfg)
        return {"numel": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in unet.modules())}

    what = [unet_config(model_cfg), adapter.settings(adapter_cfg), torch.__version__, FORMAT]
    return int(_cached("modules-", what, count)["numel"])


def trace_sampling(archs: dict, model_cfg: Model, adapter_cfg: Adapter | None, latent_hw: tuple[int, int],
                   precision: str) -> dict:
    """A validation pass (training/validation.py) on fake tensors: {"vae_params": [bytes per parameter, in the
    training dtype], "unet_peak": B (one guided step: the prompt and its negative as a batch of 2, no grad),
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

    from zerotune.plan.activations import DTYPES, _inputs, _meta_unet
    from zerotune.plan.step_tracker import StepTracker

    start, dtype = time.perf_counter(), DTYPES[precision]
    unet = _meta_unet(model_cfg, precision, False, str(model_cfg.attention), adapter_cfg).eval()
    with init_empty_weights():
        vae = AutoencoderKL.from_config({k: v for k, v in archs["vae"].items() if k != "force_upcast"})
        torch.nn.Module.to(vae, dtype)  # nn.Module's: diffusers' own `to` warns about fp32 modules
    vae_params = [p.numel() * p.element_size() for p in vae.parameters()]
    channels = int(archs["vae"].get("latent_channels", 4))
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        unet.to_empty(device="cpu")
        vae.to_empty(device="cpu")
        inputs = _inputs(model_cfg, (channels, *latent_hw), 2, dtype)
        unet_peak = _peak(StepTracker(), [unet], lambda: unet(inputs["x0"], inputs["timesteps"], **inputs["cond"]))
        latents = torch.randn(1, channels, *latent_hw, dtype=dtype)
        decode_peak = _peak(StepTracker(), [vae], lambda: vae.decode(latents).sample)
    return {"vae_params": vae_params, "unet_peak": unet_peak, "vae_decode_peak": decode_peak,
            "seconds": round(time.perf_counter() - start, 3)}


def measure_sampling_on_cpu(archs: dict, model_cfg: Model, latent_hw: tuple[int, int], steps: int = 2) -> dict:
    """A validation pass's call run for real on this CPU, at the traced size (the check on trace_sampling):
    diffusers' StableDiffusionXLPipeline with guidance, as training/validation.py calls it, on a U-Net and a VAE
    built from the same configs with random weights. {"between_ops", "with_workspaces"}: bytes held beyond the
    weights, from torch.profiler's record of every allocation and free (activations.measure_step_on_cpu's way)."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline
    from torch.profiler import ProfilerActivity, profile

    from zerotune.diffusion import noise_scheduler
    from zerotune.models import build_unet, unet_config
    from zerotune.plan.activations import _peaks
    from zerotune.sampling import make_sampler
    from zerotune.schema import Diffusion

    torch.manual_seed(0)
    unet = build_unet(model_cfg).eval()
    vae = AutoencoderKL.from_config({k: v for k, v in archs["vae"].items() if k != "force_upcast"}).eval()
    schedule = dict(noise_scheduler(Diffusion()).config)  # the training schedule's defaults
    sampler = make_sampler(schedule, str(model_cfg.prediction_type), pixel_space=False)
    config = unet_config(model_cfg)
    states = torch.randn(1, int(model_cfg.text_seq_len), int(config["cross_attention_dim"]))
    embeds: dict[str, torch.Tensor] = {"prompt_embeds": states}
    if model_cfg.conditioning == "text":  # as training/validation.py: the zeros null condition as the negative
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

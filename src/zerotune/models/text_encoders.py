"""Training the text encoders with the U-Net (`model.train_text_encoder`), each its own parameter group, whole or
with LoRA, in one module with the U-Net so one ZeRO config partitions all (as kohya's `prepare_deepspeed_model`;
accelerate's DeepSpeed path takes one model per engine); and the VAE's and encoders' architectures, from local
config.json files or the published configs of model=sdxl, sd15 and sd21 (tests/helpers/tiny_components.py's: tiny)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Adapter, Model
from zerotune.models import adapter
from zerotune.models.backbones import backbone_of

if TYPE_CHECKING:
    from transformers import CLIPPreTrainedModel


CHOICES: dict[str, tuple[str, ...]] = {"none": (), "te1": ("text_encoder",), "te2": ("text_encoder_2",),
                                       "both": ("text_encoder", "text_encoder_2")}
LR_KEYS = {"text_encoder": "text_encoder_lr", "text_encoder_2": "text_encoder_2_lr"}
TOKENS = {"text_encoder": "input_ids", "text_encoder_2": "input_ids_2"}
ENCODER_TARGETS_KEY = "adapter.text_encoder_target_modules"  # the batch's key for each encoder's tokens


def trained(model_cfg: Model) -> tuple[str, ...]:
    """The text encoders this run trains, in the order their parameter groups follow the U-Net's."""
    return CHOICES.get(str(model_cfg.train_text_encoder), ())


def check(model_cfg: Model) -> None:
    """model.train_text_encoder and its learning rates, against the model's encoders."""
    choice = str(model_cfg.train_text_encoder)
    if choice not in CHOICES:
        every = "both" if model_cfg.conditioning == "text_time" else "te1"
        raise ConfigError("model.train_text_encoder", f"unknown choice {choice!r}: none, te1, te2 (SDXL) or both "
                          "(SDXL)", f"model.train_text_encoder={every}")
    names = CHOICES[choice]
    if names and model_cfg.conditioning == "class":
        raise ConfigError("model.train_text_encoder", f"model={model_cfg.name} is conditioned on class labels: it has "
                          "no text encoder", "model.train_text_encoder=none, or a text model (model=sdxl, sd15, sd21)")
    if "text_encoder_2" in names and model_cfg.conditioning != "text_time":
        raise ConfigError("model.train_text_encoder", f"model={model_cfg.name} has one text encoder (text_encoder); "
                          f"{choice} trains text_encoder_2", "model.train_text_encoder=te1")
    for name in names:
        lr = getattr(model_cfg, LR_KEYS[name])
        if lr is not None and not float(lr) > 0:
            raise ConfigError(f"model.{LR_KEYS[name]}", f"must be positive, got {lr}",
                              f"model.{LR_KEYS[name]}=1e-6, or null for optimizer.lr")


def group_lrs(model_cfg: Model, lr: float) -> list[float]:
    """The learning rate of each parameter group: the U-Net's (`lr`, optimizer.lr), then each trained encoder's."""
    return [float(lr), *(float(getattr(model_cfg, LR_KEYS[n]) or lr) for n in trained(model_cfg))]


def encoder_class(name: str) -> type[CLIPPreTrainedModel]:
    """text_encoder_2 (SDXL's) carries the projection whose output is the pooled embedding."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection if name == "text_encoder_2" else CLIPTextModel


def build(name: str, arch: dict) -> torch.nn.Module:
    """An encoder of architecture `arch` (its config.json's fields), randomly initialised: for the planner's traces,
    and for export to load a checkpoint's weights into."""
    from transformers import CLIPTextConfig

    known = CLIPTextConfig().to_dict()
    return encoder_class(name)(CLIPTextConfig(**{k: v for k, v in arch.items() if k in known}))


def build_meta(name: str, arch: dict) -> torch.nn.Module:
    """The same on the meta device: for counting."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return build(name, arch)


def first_width(model_cfg: Model) -> int:
    """text_encoder's hidden size: its width in the cached states of SDXL ([te1 | te2])."""
    found = configs(model_cfg)
    if found is None:
        raise ConfigError("model.components", f"model={model_cfg.name}'s text encoders have no known architecture",
                          f"model.components=/path/to/a/local/{model_cfg.name}/pipeline")
    return int(found[0]["text_encoder"]["hidden_size"])


def load(name: str, path: Path, adapter_cfg: Adapter | None, gradient_checkpointing: bool) -> torch.nn.Module:
    """A trained encoder from its saved folder, fp32, in train mode; with adapter=lora frozen under its adapters.
    At ZeRO-3 transformers' from_pretrained builds it partitioned (accelerate registered the DeepSpeed config)."""
    encoder = encoder_class(name).from_pretrained(path, local_files_only=True, dtype=torch.float32)
    encoder = add_adapter(encoder, adapter_cfg)
    if gradient_checkpointing:
        checkpointing_on(encoder)
    return encoder.train()


def checkpointing_on(encoder: torch.nn.Module) -> None:
    """transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable."""
    on = getattr(encoder, "activation_checkpointing_enable", None) or encoder.gradient_checkpointing_enable
    on()


def add_adapter(encoder: torch.nn.Module, adapter_cfg: Adapter | None) -> torch.nn.Module:
    """The adapter on a text encoder: adapter=lora's settings on adapter.text_encoder_target_modules."""
    return adapter.add_adapter(encoder, adapter_cfg, encoder_targets(adapter_cfg), ENCODER_TARGETS_KEY)


def encoder_targets(adapter_cfg: Adapter | None) -> list[str]:
    return [str(t) for t in adapter_cfg.text_encoder_target_modules] if adapter_cfg is not None else []


class UNetWithTextEncoders(torch.nn.Module):
    """The engine's one module when text encoders train: the U-Net and the trained encoders. Its state dict's keys
    are prefixed `unet.`, `text_encoder.`, `text_encoder_2.`; a checkpoint's meta.json says which."""

    def __init__(self, unet: torch.nn.Module, encoders: dict[str, torch.nn.Module], pooled: bool, first_width: int):
        """`pooled`: SDXL's added conditioning; `first_width`: text_encoder's width in the cached states [te1 | te2]."""
        super().__init__()
        self.unet = unet
        self.text_encoder = encoders.get("text_encoder")
        self.text_encoder_2 = encoders.get("text_encoder_2")
        self.pooled, self.first_width = pooled, first_width

    def encoders(self) -> dict[str, torch.nn.Module]:
        return {n: m for n in TOKENS if (m := getattr(self, n)) is not None}

    def encode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The condition from the trained encoders (tokens) and the cache (the frozen encoder's part), as
        FrozenEncoders.encode_text gives it."""
        if not self.pooled:  # SD 1.x / 2.x: the one encoder's last hidden states
            assert self.text_encoder is not None
            return self.text_encoder(batch["input_ids"])[0], None
        cached = batch.get("encoder_hidden_states")
        parts, pooled = [], batch.get("text_embeds")
        for name, cut in (("text_encoder", slice(None, self.first_width)),
                          ("text_encoder_2", slice(self.first_width, None))):
            encoder = getattr(self, name)
            if encoder is None:
                assert cached is not None
                parts.append(cached[..., cut])
                continue
            out = encoder(batch[TOKENS[name]], output_hidden_states=True)
            parts.append(out.hidden_states[-2])
            if name == "text_encoder_2":
                pooled = out[0]  # the projection's text_embeds
        return torch.cat(parts, dim=-1), pooled

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, batch: dict[str, torch.Tensor],
                drop: torch.Tensor | None = None):
        """The U-Net's output on the encoded condition; `drop`: [n] bool, rows given the null condition (zeros)."""
        hidden, pooled = self.encode(batch)
        if drop is not None:
            hidden = torch.where(drop.view(-1, 1, 1), torch.zeros_like(hidden), hidden)
            if pooled is not None:
                pooled = torch.where(drop.view(-1, 1), torch.zeros_like(pooled), pooled)
        if pooled is None:
            return self.unet(sample, timestep, encoder_hidden_states=hidden)
        return self.unet(sample, timestep, encoder_hidden_states=hidden,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": batch["time_ids"]})


def param_groups(module: torch.nn.Module, lrs: list[float], sizes: Sequence[Sequence[int]]) -> list[dict]:
    """What the optimizer gets: each trained module's trainable parameters with its lr, cut into the contiguous
    groups `sizes` gives (param_groups.layout: per module, the parameters each of its groups holds)."""
    modules = [module.unet, *module.encoders().values()] if isinstance(module, UNetWithTextEncoders) else [module]
    groups = []
    for m, lr, counts in zip(modules, lrs, sizes, strict=True):
        params = adapter.trainable_parameters(m)
        if sum(counts) != len(params):
            raise RuntimeError(f"{len(params)} trainable parameters, but the resolved run's groups hold "
                               f"{sum(counts)}: the model changed after preflight")
        start = 0
        for n in counts:
            groups.append({"params": params[start:start + n], "lr": lr})
            start += n
    return groups


_CLIP = {"vocab_size": 49408, "max_position_embeddings": 77}
# stabilityai/stable-diffusion-xl-base-1.0: vae/config.json, text_encoder/config.json (CLIP ViT-L/14's text
# model), text_encoder_2/config.json (OpenCLIP ViT-bigG/14's text model, with its projection).
SDXL: dict[str, dict] = {
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
SDXL_TINY: dict[str, dict] = {
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
# black-forest-labs/FLUX.1-dev and stabilityai/stable-diffusion-3.5-large: vae/config.json (16 latent channels, no
# quant convs, each its scale and shift), text_encoder*/config.json (CLIP-L; SD3 adds CLIP-G, both projected; T5
# v1.1 XXL's encoder).
_FLOW_VAE = {**SDXL["vae"], "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False}
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
          "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6}
FLUX = {"vae": {**_FLOW_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "text_encoder": SDXL["text_encoder"], "text_encoder_2": T5_XXL}
SD35 = {"vae": {**_FLOW_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "text_encoder": SDXL["text_encoder"], "text_encoder_2": SDXL["text_encoder_2"], "text_encoder_3": T5_XXL}
_TINY_FLOW_VAE = {**SDXL_TINY["vae"], "scaling_factor": 0.3611, "shift_factor": 0.1159}
_TINY_T5 = {"vocab_size": 174, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 2}
_TINY_CLIP = {**_TINY_TEXT, "vocab_size": 528}  # the tests' tokenizer's length
FLUX_TINY = {"vae": _TINY_FLOW_VAE, "text_encoder": {**_TINY_CLIP, "hidden_size": 32}, "text_encoder_2": _TINY_T5}
_TINY_CLIP_16 = {**_TINY_CLIP, "hidden_size": 16, "projection_dim": 32}
SD3_TINY = {"vae": _TINY_FLOW_VAE, "text_encoder": _TINY_CLIP_16, "text_encoder_2": _TINY_CLIP_16,
            "text_encoder_3": _TINY_T5}
BUILTIN: dict[str, tuple[dict, str]] = {
    "flux": (FLUX, "FLUX.1-dev's vae/, text_encoder/, text_encoder_2/ config.json"),
    "sd35_large": (SD35, "SD3.5 Large's vae/, text_encoder/, text_encoder_2/, text_encoder_3/ config.json"),
    "sd35_medium": (SD35, "SD3.5 Medium's vae/, text_encoder/, text_encoder_2/, text_encoder_3/ config.json"),
    "flux_tiny": (FLUX_TINY, "tests/helpers/tiny_components.py (conf/model/flux_tiny.yaml)"),
    "sd3_tiny": (SD3_TINY, "tests/helpers/tiny_components.py (conf/model/sd3_tiny.yaml)"),
    "sdxl": (SDXL, "SDXL base 1.0's vae/, text_encoder/, text_encoder_2/ config.json"),
    "sdxl_tiny": (SDXL_TINY, "tests/helpers/tiny_components.py (conf/model/sdxl_tiny.yaml)"),
    "sd15": (SD15, "Stable Diffusion 1.5's vae/, text_encoder/ config.json"),
    "sd21": (SD21, "Stable Diffusion 2.1's vae/, text_encoder/ config.json"),
    "sd15_tiny": (SD15_TINY, "tests/helpers/tiny_components.py (conf/model/sd15_tiny.yaml)")}


def configs(model_cfg: Model) -> tuple[dict, str] | None:
    """The VAE's and text encoders' architectures and where they come from; None when neither local folders nor a
    built-in set describe them."""
    base = model_cfg.components
    found = {}
    for name in (n for n in backbone_of(model_cfg).components() if not n.startswith("tokenizer")):
        own = getattr(model_cfg, name) or (Path(str(base)) / name if base else None)
        file = Path(str(own)).expanduser() / "config.json" if own else None
        if file is None or not file.is_file():
            break
        found[name] = {k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")}
    else:
        return found, "the components' own config.json (model.components / model.vae, ...)"
    return BUILTIN.get(str(model_cfg.name))

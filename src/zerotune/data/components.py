"""The frozen VAE, text encoders and tokenizers from local folders (their own keys, model.vae, ..., winning over
model.components' subfolders; nothing downloaded), checked against the network before any weights load. Which
ones, and how they encode, the backbone says (models/backbones.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Model
from zerotune.data.latent_cache import FileHasher, digest
from zerotune.models import downsample_factor, unet_config
from zerotune.models.backbones import backbone_of, is_transformer
from zerotune.models.weights import transformers_zero3_lifted

# Files from_pretrained loads, in the order it looks for them; anything else in the folder
# (other precision variants, READMEs) does not change what is computed.
_WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors", "diffusion_pytorch_model.bin",
            "pytorch_model.bin")
# Config fields that record who saved a file, not what it computes.
_VOLATILE = {"_diffusers_version", "transformers_version", "_name_or_path", "_commit_hash", "architectures",
             "dtype", "torch_dtype", "_class_name"}


@dataclass(frozen=True)
class ComponentPaths:
    vae: Path
    text_encoder: Path
    tokenizer: Path
    text_encoder_2: Path | None = None  # SDXL's second CLIP, FLUX.1's T5; None for SD 1.x / 2.x
    tokenizer_2: Path | None = None
    text_encoder_3: Path | None = None  # SD3's T5
    tokenizer_3: Path | None = None

    def text_pairs(self) -> list[tuple[Path, Path]]:
        """(tokenizer, text encoder) folders, in the pipeline's order."""
        pairs = [(self.tokenizer, self.text_encoder), (self.tokenizer_2, self.text_encoder_2),
                 (self.tokenizer_3, self.text_encoder_3)]
        return [(t, e) for t, e in pairs if t is not None and e is not None]


def component_names(model_cfg: Model) -> tuple[str, ...]:
    """The components a model's conditioning needs."""
    return tuple(backbone_of(model_cfg).components())


def resolve_components(model_cfg: Model) -> ComponentPaths:
    """Where each component lives; a ConfigError naming the key for one that is missing."""
    base = Path(str(model_cfg.components)).expanduser() if model_cfg.components else None
    if base is not None and not base.is_dir():
        raise ConfigError("model.components", f"{base} is not a folder",
                          f"model.components=/path/to/a/local/{model_cfg.name}/pipeline (with vae/, text_encoder/, ...)")
    found = {}
    for name in component_names(model_cfg):
        own = getattr(model_cfg, name)
        path = Path(str(own)).expanduser() if own else (base / name if base is not None else None)
        key = f"model.{name}" if own or base is None else "model.components"
        marker = "tokenizer_config.json" if name.startswith("tokenizer") else "config.json"
        if path is None:
            raise ConfigError(f"model.{name}", "data=folder encodes images and captions, but no local "
                              f"{name} was given", f"model.components=/path/to/{model_cfg.name}_pipeline or "
                              f"model.{name}=/path")
        if not (path / marker).is_file():
            raise ConfigError(key, f"{path} has no {marker}: not a saved {name}",
                              f"point model.{name} (or model.components) at a folder saved by save_pretrained")
        found[name] = path
    return ComponentPaths(**found)


def _config(path: Path, key: str = "model.components") -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{path / 'config.json'} is unreadable ({exc})",
                          "point it at a folder saved by save_pretrained") from exc


def _field(config: dict, name: str, key: str, path: Path) -> Any:
    if name not in config:
        raise ConfigError(key, f"{path / 'config.json'} has no {name!r}: not the expected model type",
                          "an AutoencoderKL for vae, CLIPTextModel(WithProjection) or T5EncoderModel for the "
                          "text encoders")
    return config[name]


def check_compatible(model_cfg: Model, paths: ComponentPaths) -> None:
    """The components' output shapes against what the network takes, from their configs alone."""
    _check_vae(model_cfg, paths, backbone_of(model_cfg).latent_channels())
    if is_transformer(model_cfg):
        _check_transformer_text(model_cfg, paths)
        return
    unet = unet_config(model_cfg)
    te1 = _config(paths.text_encoder, "model.text_encoder")
    h1 = int(_field(te1, "hidden_size", "model.text_encoder", paths.text_encoder))
    encoders = [("model.text_encoder", te1)]
    if paths.text_encoder_2 is None:  # SD 1.x / 2.x: cross-attention on the one encoder's states
        if h1 != int(unet.get("cross_attention_dim") or 0):
            raise ConfigError("model.text_encoder", f"its hidden size is {h1}; the U-Net's cross_attention_dim is "
                              f"{unet.get('cross_attention_dim')}", "the text encoder the U-Net was made for")
    else:
        te2 = _config(paths.text_encoder_2, "model.text_encoder_2")
        encoders.append(("model.text_encoder_2", te2))
        h2 = int(_field(te2, "hidden_size", "model.text_encoder_2", paths.text_encoder_2))
        if h1 + h2 != int(unet.get("cross_attention_dim") or 0):
            raise ConfigError("model.text_encoder", f"the text encoders' hidden sizes add up to {h1 + h2} "
                              f"({h1} + {h2}); the U-Net's cross_attention_dim is {unet.get('cross_attention_dim')}",
                              "the text encoders the U-Net was made for")
        pooled = int(unet["projection_class_embeddings_input_dim"]) - 6 * int(unet["addition_time_embed_dim"])
        if int(te2.get("projection_dim", -1)) != pooled:
            raise ConfigError("model.text_encoder_2", f"its pooled embedding has {te2.get('projection_dim')} "
                              f"values; the U-Net expects {pooled}", "the text_encoder_2 the U-Net was made for")
    seq = int(model_cfg.text_seq_len)
    for key, cfg in encoders:
        if int(cfg.get("max_position_embeddings", seq)) < seq:
            raise ConfigError(key, f"takes at most {cfg['max_position_embeddings']} tokens, "
                              f"model.text_seq_len is {seq}", f"model.text_seq_len={cfg['max_position_embeddings']}")


def _check_vae(model_cfg: Model, paths: ComponentPaths, channels: int) -> None:
    vae = _config(paths.vae, "model.vae")
    vae_factor = 2 ** (len(_field(vae, "block_out_channels", "model.vae", paths.vae)) - 1)
    if vae_factor != model_cfg.vae_scale_factor:
        raise ConfigError("model.vae", f"{paths.vae} downsamples by {vae_factor}, but model={model_cfg.name} "
                          f"says vae_scale_factor={model_cfg.vae_scale_factor}",
                          f"model.vae_scale_factor={vae_factor}, or the VAE the network was made for")
    if int(vae.get("latent_channels", 4)) != channels:
        raise ConfigError("model.vae", f"{paths.vae} makes {vae.get('latent_channels')}-channel latents; "
                          f"model={model_cfg.name} denoises {channels}", "the VAE the network was made for")


def _check_transformer_text(model_cfg: Model, paths: ComponentPaths) -> None:
    """FLUX.1 / SD3: T5's width is the token states' (joint_attention_dim); the CLIPs' pooled outputs side by side
    (CLIP-L's hidden size for FLUX.1, the projections for SD3) are the pooled embedding; SD3's CLIP tokenizers
    pad to model.clip_tokens."""
    backbone = backbone_of(model_cfg)
    widths, pooled = backbone.text_widths(), 0
    for name, cls in backbone.components().items():
        path, key = getattr(paths, name), f"model.{name}"
        if cls == "CLIPTokenizer" and model_cfg.clip_tokens:
            length = json.loads((path / "tokenizer_config.json").read_text()).get("model_max_length")
            if length != model_cfg.clip_tokens:
                raise ConfigError(key, f"{path} pads captions to {length} tokens; model={model_cfg.name} takes "
                                  f"{model_cfg.clip_tokens} from each CLIP (model.clip_tokens)",
                                  f"model.clip_tokens={length}, or the tokenizer the model was made for")
        if not name.startswith("text_encoder"):
            continue
        config = _config(path, key)
        if cls == "T5EncoderModel":
            width = int(_field(config, "d_model", key, path))
            if width != widths.hidden:
                raise ConfigError(key, f"{path}'s T5 is {width} wide; model={model_cfg.name}'s joint_attention_dim "
                                  f"is {widths.hidden}", "the T5 encoder the model was made for (T5-XXL: 4096)")
        else:
            pooled += int(_field(config, "projection_dim" if cls.endswith("WithProjection") else "hidden_size",
                                 key, path))
    if pooled != widths.pooled:
        raise ConfigError("model.text_encoder", f"the CLIP encoders' pooled outputs add up to {pooled} values; "
                          f"model={model_cfg.name}'s pooled_projection_dim is {widths.pooled}",
                          "the CLIP encoders the model was made for")


def check_bucket_step(model_cfg: Model, step: int) -> None:
    """Every bucket side must become a latent side the U-Net can halve down to its bottleneck."""
    unit = model_cfg.vae_scale_factor * downsample_factor(model_cfg)
    if step <= 0 or step % unit:
        raise ConfigError("data.bucket_step", f"{step} px is not a multiple of {unit} (model={model_cfg.name} "
                          "encodes by vae_scale_factor and its U-Net halves the rest)",
                          f"data.bucket_step={64 if 64 % unit == 0 else unit * max(1, -(-step // unit))}")


def _weights_files(path: Path) -> list[str]:
    for name in _WEIGHTS:
        if (path / name).is_file():
            return [name]
        index = path / f"{name}.index.json"
        if index.is_file():
            return [index.name, *sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != "config.json")


def component_id(path: Path, hasher: FileHasher) -> str:
    """What the component computes: its config (minus who-saved-it fields) and its weights' bytes."""
    config = {k: v for k, v in _config(path).items() if k not in _VOLATILE}
    return digest(config, [(name, hasher.file(path / name)) for name in _weights_files(path)])


def component_ids(paths: ComponentPaths, hasher: FileHasher) -> dict[str, str]:
    """{"vae": ..., "text": ...}: latents depend on the first, text embeddings on the second."""
    pairs = paths.text_pairs()
    text = digest(*[component_id(encoder, hasher) for _, encoder in pairs],
                  *[hasher.folder(tokenizer) for tokenizer, _ in pairs])
    return {"vae": component_id(paths.vae, hasher), "text": text}


def tokenize(paths: ComponentPaths, names: tuple[str, ...], captions: list[str], seq_len: int) -> dict[str, torch.Tensor]:
    """{"input_ids": [n, seq], "input_ids_2": ...}: the captions' tokens for each trained encoder (`names`),
    padded and truncated as FrozenEncoders encodes them."""
    from transformers import CLIPTokenizer

    folders = {"text_encoder": ("input_ids", paths.tokenizer), "text_encoder_2": ("input_ids_2", paths.tokenizer_2)}
    out = {}
    for name in names:
        key, folder = folders[name]
        tok = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
        out[key] = tok(captions, padding="max_length", max_length=seq_len, truncation=True,
                       return_tensors="pt").input_ids
    return out


class FrozenEncoders:
    """The frozen VAE and text encoders the model's backbone names, each loaded on first use, in fp32, on `device`."""

    def __init__(self, paths: ComponentPaths, device: torch.device, model_cfg: Model):
        self.paths, self.device, self.backbone = paths, device, backbone_of(model_cfg)
        self._vae: Any = None
        self._text: dict[str, Any] | None = None

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, h, w] in [-1, 1] -> latents the network trains on: the posterior's mean (the cache holds one
        deterministic value per image), shifted (FLUX.1's and SD3's VAEs have a shift factor) and scaled."""
        vae = self._load_vae()
        latents = vae.encode(pixels.to(self.device, torch.float32)).latent_dist.mean
        shift = vae.config.get("shift_factor") or 0.0
        return ((latents - shift) * vae.config.scaling_factor).float().cpu()

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The condition the model's pipeline makes of `captions` (backbone.encode_text), in fp32 on the host."""
        hidden, pooled = self.backbone.encode_text(self._load_text(), captions, self.device)
        return hidden.float().cpu(), None if pooled is None else pooled.float().cpu()

    def _load_vae(self) -> Any:
        if self._vae is None:
            from diffusers import AutoencoderKL

            with transformers_zero3_lifted():
                self._vae = AutoencoderKL.from_pretrained(self.paths.vae, local_files_only=True,
                                                          torch_dtype=torch.float32).to(self.device).eval()
        return self._vae

    def _load_text(self) -> dict[str, Any]:
        if self._text is None:
            import transformers

            def load(name: str, cls: str) -> Any:
                loader = getattr(transformers, cls)
                if name.startswith("tokenizer"):
                    return loader.from_pretrained(getattr(self.paths, name), local_files_only=True)
                model = loader.from_pretrained(getattr(self.paths, name), local_files_only=True, dtype=torch.float32)
                return model.to(self.device).eval()

            with transformers_zero3_lifted():
                self._text = {name: load(name, cls) for name, cls in self.backbone.components().items()
                              if name != "vae"}
        return self._text

    def release(self) -> None:
        """Drop the encoders: training keeps only the U-Net on the accelerator."""
        self._vae = self._text = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

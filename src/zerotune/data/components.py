"""The frozen VAE, text encoders and tokenizers from local folders (their own keys, model.vae, ..., winning over
model.components' subfolders; nothing downloaded), checked against the U-Net before any weights load."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Model
from zerotune.data.latent_cache import FileHasher, digest
from zerotune.models import downsample_factor, unet_config

NAMES = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
ONE_ENCODER = ("vae", "text_encoder", "tokenizer")  # conditioning: text (SD 1.x / 2.x)
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
    text_encoder_2: Path | None = None  # SDXL's second encoder; None for SD 1.x / 2.x
    tokenizer_2: Path | None = None

    def text_pairs(self) -> list[tuple[Path, Path]]:
        """(tokenizer, text encoder) folders, in the order their states are concatenated."""
        pairs = [(self.tokenizer, self.text_encoder)]
        if self.text_encoder_2 is not None and self.tokenizer_2 is not None:
            pairs.append((self.tokenizer_2, self.text_encoder_2))
        return pairs


def component_names(model_cfg: Model) -> tuple[str, ...]:
    """The components a model's conditioning needs."""
    return ONE_ENCODER if model_cfg.conditioning == "text" else NAMES


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
                          "an AutoencoderKL for vae, CLIPTextModel(WithProjection) for the text encoders")
    return config[name]


def check_compatible(model_cfg: Model, paths: ComponentPaths) -> None:
    """The components' output shapes against what the U-Net takes, from their configs alone."""
    unet = unet_config(model_cfg)
    vae = _config(paths.vae, "model.vae")
    te1 = _config(paths.text_encoder, "model.text_encoder")
    vae_factor = 2 ** (len(_field(vae, "block_out_channels", "model.vae", paths.vae)) - 1)
    if vae_factor != model_cfg.vae_scale_factor:
        raise ConfigError("model.vae", f"{paths.vae} downsamples by {vae_factor}, but model={model_cfg.name} "
                          f"says vae_scale_factor={model_cfg.vae_scale_factor}",
                          f"model.vae_scale_factor={vae_factor}, or the VAE the U-Net was made for")
    if int(vae.get("latent_channels", 4)) != int(unet["in_channels"]):
        raise ConfigError("model.vae", f"{paths.vae} makes {vae.get('latent_channels')}-channel latents; the "
                          f"U-Net takes {unet['in_channels']}", "the VAE the U-Net was made for")
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


@contextlib.contextmanager
def whole_frozen_models() -> Iterator[None]:
    """The encoders are loaded whole, never partitioned. At ZeRO-3 accelerate registers its DeepSpeed config
    with transformers (`DeepSpeedPlugin.dschf`), whose from_pretrained then builds under zero.Init and leaves
    each rank a 1-D placeholder of every weight, which no engine ever gathers. accelerate's own
    `zero3_init_context_manager(enable=False)` registers the same ZeRO-3 config again (it builds the
    HfDeepSpeedConfig whatever the flag), so transformers' registration is lifted here and put back after."""
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    registered = getattr(plugin, "dschf", None)
    if registered is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


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
    """The frozen VAE and text encoders, each loaded on first use, in fp32, on `device`."""

    def __init__(self, paths: ComponentPaths, device: torch.device, seq_len: int = 77):
        self.paths, self.device, self.seq_len = paths, device, seq_len
        self._vae = self._text = None

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, 3, h, w] in [-1, 1] -> latents the U-Net trains on: the posterior's mean (the cache holds one
        deterministic value per image), scaled."""
        vae = self._load_vae()
        latents = vae.encode(pixels.to(self.device, torch.float32)).latent_dist.mean
        shift = vae.config.get("shift_factor") or 0.0
        return ((latents - shift) * vae.config.scaling_factor).float().cpu()

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """SDXL's conditioning: both encoders' penultimate hidden states side by side [n, seq, d1 + d2],
        and text_encoder_2's projected pooled embedding [n, p]. SD 1.x / 2.x: the one encoder's last hidden
        states (final layer norm applied, as StableDiffusionPipeline.encode_prompt takes them), no pooled."""
        pairs = self._load_text()
        if len(pairs) == 1:
            tok, enc = pairs[0]
            return enc(self._ids(tok, captions))[0].float().cpu(), None
        states, pooled = [], None
        for tok, enc in pairs:
            out = enc(self._ids(tok, captions), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled = out[0]  # for text_encoder_2 (a ...WithProjection model), its text_embeds
        assert pooled is not None
        return torch.cat(states, dim=-1).float().cpu(), pooled.float().cpu()

    def _ids(self, tok, captions: list[str]) -> torch.Tensor:
        return tok(captions, padding="max_length", max_length=self.seq_len, truncation=True,
                   return_tensors="pt").input_ids.to(self.device)

    def _load_vae(self):
        if self._vae is None:
            from diffusers import AutoencoderKL

            with whole_frozen_models():
                self._vae = AutoencoderKL.from_pretrained(self.paths.vae, local_files_only=True,
                                                          torch_dtype=torch.float32).to(self.device).eval()
        return self._vae

    def _load_text(self):
        if self._text is None:
            from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

            def model(cls, path: Path):
                return cls.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(self.device).eval()

            classes = [CLIPTextModel, CLIPTextModelWithProjection]
            with whole_frozen_models():
                self._text = [(CLIPTokenizer.from_pretrained(tok, local_files_only=True), model(cls, enc))
                              for (tok, enc), cls in zip(self.paths.text_pairs(), classes, strict=False)]
        return self._text

    def release(self) -> None:
        """Drop the encoders: training keeps only the U-Net on the accelerator."""
        self._vae = self._text = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

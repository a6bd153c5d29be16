"""The denoising networks zerotune trains, behind one seam: each family says which diffusers class it is, what
latents and text it takes, and how one call of it goes. U-Nets (SD 1.x/2.x, SDXL: `UNet2DConditionModel`) and
diffusion transformers (FLUX.1: `FluxTransformer2DModel`; SD3/3.5: `SD3Transformer2DModel`). The model option's
`backbone` names the family; the trainer, the planner and the data ask it, never the family's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from omegaconf import OmegaConf

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Model

if TYPE_CHECKING:
    import torch
    from diffusers.models.modeling_utils import ModelMixin


Encoded = tuple["torch.Tensor", "torch.Tensor | None"]  # one prompt's (token states [1, seq, d], pooled [1, p] or None)


@dataclass(frozen=True)
class TextWidths:
    """What a text-conditioned backbone takes: the width of each token's hidden state, and of the pooled
    embedding (0: none)."""

    hidden: int
    pooled: int


class Backbone(Protocol):
    folder: ClassVar[str]         # the subfolder of a diffusers pipeline folder that holds it; export's too
    class_name: ClassVar[str]     # diffusers' class, as a saved config.json's `_class_name` names it
    lora_pipeline: ClassVar[str]  # the pipeline class whose save_lora_weights / load_lora_weights take its LoRA
    # whether diffusers' LoRA scripts for it save peft's own names (lora_A / lora_B: FLUX.1's, SD3's) rather than
    # diffusers' older lora.down / lora.up (the U-Nets')
    lora_peft_names: ClassVar[bool]
    sampling_rows: ClassVar[int]  # rows of one sampling step's network call: 2 where guided by a negative, else 1

    @property
    def model(self) -> Model:
        """The model option the network is built from."""

    def arguments(self) -> dict[str, Any]:
        """The diffusers class's constructor arguments (the model option's architecture)."""

    def model_class(self) -> type[ModelMixin]:
        """The diffusers class (imported on demand: diffusers' import takes seconds)."""

    def latent_channels(self) -> int:
        """Channels of the latents the VAE makes (and the network denoises)."""

    def size_unit(self) -> int:
        """Pixel sides must be a multiple of this: the VAE's factor times the network's own (a U-Net's halvings,
        a transformer's patch)."""

    def size_reason(self) -> str:
        """Why sides are multiples of size_unit(), in words."""

    def text_widths(self) -> TextWidths:
        """The text conditioning's widths (a class-conditional U-Net: the hidden width is 0)."""

    def predict(self, module: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict,
                guidance: float) -> torch.Tensor:
        """The network's output for `noisy` latents (B, C, H, W) at `timesteps` (the schedule's values), in the
        latents' layout. `cond`: models/diffusion.py condition_kwargs; `guidance`: FLUX.1-dev's distilled
        guidance (diffusion.guidance_scale), for a network with a guidance embedding."""

    def components(self) -> dict[str, str]:
        """The frozen parts its data and validation load, {subfolder: class}: diffusers' VAE, transformers'
        encoders and tokenizers, in the pipeline's order."""

    def encode_text(self, modules: dict[str, Any], captions: list[str],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The condition its pipeline makes of `captions` ([n, model.text_seq_len, hidden], pooled [n, p] or
        None), from the loaded encoders and tokenizers (`modules`, by subfolder)."""

    def sampler(self, trained: dict[str, Any], prediction_type: str) -> Any:
        """The scheduler validation samples with; `trained`: the training schedule's config."""

    def sampling_pipeline(self, network: torch.nn.Module, vae: Any, scheduler: Any) -> Any:
        """Its diffusers pipeline around the trained network, without text encoders (prompts come encoded)."""

    def sampling_kwargs(self, prompt: Encoded, negative: Encoded | None, guidance_rescale: float) -> dict[str, Any]:
        """The pipeline call's condition arguments for one encoded prompt (and negative prompt)."""


def _architecture(block: Any) -> dict[str, Any]:
    return dict(block) if isinstance(block, dict) else OmegaConf.to_container(block, resolve=True)  # type: ignore[return-value]


def diffusers_class(class_name: str) -> type[ModelMixin]:
    """diffusers' class of that name (imported on demand: diffusers' import takes seconds)."""
    import diffusers

    return getattr(diffusers, class_name)


@dataclass(frozen=True)
class UNet:
    """SD 1.x / 2.x / SDXL: `UNet2DConditionModel(**model.unet)`, called as unet(sample, t, **cond).sample."""

    model: Model
    folder: ClassVar[str] = "unet"  # a pipeline folder's subfolder holding it, and export's
    class_name: ClassVar[str] = "UNet2DConditionModel"
    lora_pipeline: ClassVar[str] = "StableDiffusionXLPipeline"  # its save_lora_weights writes `unet.` keys
    lora_peft_names: ClassVar[bool] = False
    sampling_rows: ClassVar[int] = 2

    def arguments(self) -> dict[str, Any]:
        return _architecture(self.model.unet)

    def model_class(self) -> type[ModelMixin]:
        return diffusers_class(self.class_name)

    def latent_channels(self) -> int:
        return int(self.arguments()["in_channels"])

    def size_unit(self) -> int:
        """The VAE's factor times the U-Net's halvings: one fewer than its blocks."""
        return int(self.model.vae_scale_factor) * 2 ** (len(self.arguments()["block_out_channels"]) - 1)

    def size_reason(self) -> str:
        return f"its U-Net halves {len(self.arguments()['block_out_channels']) - 1} times"

    def text_widths(self) -> TextWidths:
        unet = self.arguments()
        # SDXL's pooled text embedding: what the added-conditioning projection takes besides its 6 time ids
        pooled = int(unet["projection_class_embeddings_input_dim"]) - 6 * int(unet["addition_time_embed_dim"]) \
            if unet.get("addition_embed_type") == "text_time" else 0
        return TextWidths(int(unet.get("cross_attention_dim") or 0), pooled)

    def predict(self, module: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict,
                guidance: float) -> torch.Tensor:
        return module(noisy, timesteps, **cond).sample

    def components(self) -> dict[str, str]:
        second = {"text_encoder_2": "CLIPTextModelWithProjection", "tokenizer_2": "CLIPTokenizer"}
        return {"vae": "AutoencoderKL", "text_encoder": "CLIPTextModel", "tokenizer": "CLIPTokenizer",
                **(second if self.model.conditioning == "text_time" else {})}

    def encode_text(self, modules: dict[str, Any], captions: list[str],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """SD 1.x / 2.x: the one encoder's last hidden states (its final layer norm applied, as
        StableDiffusionPipeline.encode_prompt takes them), no pooled. SDXL: both encoders' penultimate hidden states
        side by side [n, seq, d1 + d2], and text_encoder_2's projected pooled embedding. Written out: the SDXL
        pipeline's encode_prompt pads to the tokenizer's length, where the cache's keys take model.text_seq_len."""
        import torch

        def ids(tokenizer: Any) -> torch.Tensor:
            return tokenizer(captions, padding="max_length", max_length=int(self.model.text_seq_len),
                             truncation=True, return_tensors="pt").input_ids.to(device)

        if self.model.conditioning == "text":
            return modules["text_encoder"](ids(modules["tokenizer"]))[0], None
        states, pooled = [], None
        for suffix in ("", "_2"):
            out = modules[f"text_encoder{suffix}"](ids(modules[f"tokenizer{suffix}"]), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled = out[0]  # text_encoder_2's (a ...WithProjection model's) text_embeds
        return torch.cat(states, dim=-1), pooled

    def sampler(self, trained: dict[str, Any], prediction_type: str) -> Any:
        from zerotune.models.diffusion import make_sampler

        return make_sampler(trained, prediction_type, pixel_space=False)

    def sampling_pipeline(self, network: torch.nn.Module, vae: Any, scheduler: Any) -> Any:
        if self.model.conditioning == "text":  # SD 1.x / 2.x
            from diffusers import StableDiffusionPipeline

            return StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=network,
                                           scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                           requires_safety_checker=False)
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                         tokenizer_2=None, unet=network, scheduler=scheduler, add_watermarker=False,
                                         force_zeros_for_empty_prompt=True)

    def sampling_kwargs(self, prompt: Encoded, negative: Encoded | None, guidance_rescale: float) -> dict[str, Any]:
        import torch

        states, pooled = prompt
        kwargs: dict[str, Any] = {"prompt_embeds": states, "guidance_rescale": guidance_rescale}
        if pooled is not None:  # SDXL's added conditioning
            kwargs["pooled_prompt_embeds"] = pooled
        if negative is not None:
            kwargs["negative_prompt_embeds"] = negative[0]
            if negative[1] is not None:
                kwargs["negative_pooled_prompt_embeds"] = negative[1]
        elif pooled is None:
            # SD 1.x / 2.x would tokenize "" (no tokenizer here); zeros are the null condition trained on
            # (models/diffusion.drop_condition), as SDXL's force_zeros_for_empty_prompt
            kwargs["negative_prompt_embeds"] = torch.zeros_like(states)
        return kwargs


@dataclass(frozen=True)
class _Transformer:
    """What FLUX.1's and SD3's transformers share: `model.transformer` holds the class's arguments, the text comes
    as token states of joint_attention_dim and a pooled embedding, the LoRA in peft's names."""

    model: Model
    folder: ClassVar[str] = "transformer"
    class_name: ClassVar[str]
    lora_pipeline: ClassVar[str]
    lora_peft_names: ClassVar[bool] = True
    component_classes: ClassVar[dict[str, str]]  # components(): the same for every model of the family

    def arguments(self) -> dict[str, Any]:
        return _architecture(self.model.transformer)

    def model_class(self) -> type[ModelMixin]:
        return diffusers_class(self.class_name)

    def text_widths(self) -> TextWidths:
        arch = self.arguments()
        return TextWidths(int(arch["joint_attention_dim"]), int(arch["pooled_projection_dim"]))

    def components(self) -> dict[str, str]:
        return dict(self.component_classes)

    def t5_tokens(self) -> int:
        """T5's tokens per caption: the condition's, less CLIP's ahead of them (SD3's)."""
        return int(self.model.text_seq_len) - int(self.model.clip_tokens)

    def sampler(self, trained: dict[str, Any], prediction_type: str) -> Any:
        """The model's own flow schedule (the pipeline's), which the trained one is."""
        from zerotune.models.flow_matching import flow_schedule

        return flow_schedule(self.model)

    def _pipeline(self, **parts: Any) -> Any:
        """Its pipeline class, every part not given left out (None)."""
        cls = diffusers_class(self.lora_pipeline)
        names = ("scheduler", "vae", "transformer", *(n for n in self.components() if n != "vae"))
        return cls(**{n: parts.get(n) for n in names})

    def sampling_pipeline(self, network: torch.nn.Module, vae: Any, scheduler: Any) -> Any:
        return self._pipeline(transformer=network, vae=vae, scheduler=scheduler)


@dataclass(frozen=True)
class Flux(_Transformer):
    """FLUX.1: `FluxTransformer2DModel(**model.transformer)` over 2x2 patches of the latents packed into tokens,
    with image and text position ids, the timestep in [0, 1] and (dev) a guidance embedding, as diffusers'
    train_dreambooth_flux.py calls it."""

    class_name: ClassVar[str] = "FluxTransformer2DModel"
    lora_pipeline: ClassVar[str] = "FluxPipeline"
    sampling_rows: ClassVar[int] = 1  # its guidance is distilled into an embedding
    component_classes: ClassVar[dict[str, str]] = {
        "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel", "tokenizer": "CLIPTokenizer",
        "text_encoder_2": "T5EncoderModel", "tokenizer_2": "T5TokenizerFast"}

    def latent_channels(self) -> int:
        return int(self.arguments()["in_channels"]) // 4  # a token packs a 2x2 patch of every channel

    def size_unit(self) -> int:
        return int(self.model.vae_scale_factor) * 2

    def size_reason(self) -> str:
        return "its transformer packs 2x2 latent patches into a token"

    def predict(self, module: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict,
                guidance: float) -> torch.Tensor:
        import torch
        from diffusers import FluxPipeline

        batch, channels, height, width = noisy.shape
        packed = FluxPipeline._pack_latents(noisy, batch, channels, height, width)
        image_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, noisy.device, noisy.dtype)
        text = cond["encoder_hidden_states"]
        text_ids = torch.zeros(text.shape[1], 3, device=noisy.device, dtype=noisy.dtype)
        embedded = None
        if self.arguments().get("guidance_embeds"):
            embedded = torch.full((batch,), float(guidance), device=noisy.device, dtype=torch.float32)
        out = module(hidden_states=packed, timestep=timesteps.to(noisy.dtype) / 1000, guidance=embedded,
                     pooled_projections=cond["pooled_projections"], encoder_hidden_states=text, txt_ids=text_ids,
                     img_ids=image_ids, return_dict=False)[0]
        vae = int(self.model.vae_scale_factor)
        return FluxPipeline._unpack_latents(out, height * vae, width * vae, vae)

    def encode_text(self, modules: dict[str, Any], captions: list[str],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FluxPipeline.encode_prompt's: T5's last hidden states [n, t5_tokens, 4096] and CLIP-L's pooled output."""
        states, pooled, _ = self._pipeline(**modules).encode_prompt(captions, device=device,
                                                                     max_sequence_length=self.t5_tokens())
        return states, pooled

    def sampling_kwargs(self, prompt: Encoded, negative: Encoded | None, guidance_rescale: float) -> dict[str, Any]:
        """FLUX.1-dev's guidance is distilled into its guidance embedding (the call's guidance_scale): one pass per
        step, no negative prompt."""
        return {"prompt_embeds": prompt[0], "pooled_prompt_embeds": prompt[1]}


@dataclass(frozen=True)
class SD3(_Transformer):
    """SD3 / SD3.5: `SD3Transformer2DModel(**model.transformer)`, patching the latents itself, called on the
    timestep in [0, 1000] as diffusers' train_dreambooth_sd3.py calls it."""

    class_name: ClassVar[str] = "SD3Transformer2DModel"
    lora_pipeline: ClassVar[str] = "StableDiffusion3Pipeline"
    sampling_rows: ClassVar[int] = 2
    component_classes: ClassVar[dict[str, str]] = {
        "vae": "AutoencoderKL", "text_encoder": "CLIPTextModelWithProjection", "tokenizer": "CLIPTokenizer",
        "text_encoder_2": "CLIPTextModelWithProjection", "tokenizer_2": "CLIPTokenizer",
        "text_encoder_3": "T5EncoderModel", "tokenizer_3": "T5TokenizerFast"}

    def latent_channels(self) -> int:
        return int(self.arguments()["in_channels"])

    def size_unit(self) -> int:
        return int(self.model.vae_scale_factor) * int(self.arguments().get("patch_size", 2))

    def size_reason(self) -> str:
        return f"its transformer takes {self.arguments().get('patch_size', 2)}-pixel latent patches"

    def predict(self, module: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict,
                guidance: float) -> torch.Tensor:
        return module(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=cond["encoder_hidden_states"],
                      pooled_projections=cond["pooled_projections"], return_dict=False)[0]

    def encode_text(self, modules: dict[str, Any], captions: list[str],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """StableDiffusion3Pipeline.encode_prompt's: CLIP-L's and CLIP-G's penultimate states side by side, padded to
        T5's width, then T5's [n, clip_tokens + t5_tokens, 4096]; both CLIPs' projected pooled embeddings."""
        states, _, pooled, _ = self._pipeline(**modules).encode_prompt(
            captions, None, None, device=device, do_classifier_free_guidance=False,
            max_sequence_length=self.t5_tokens())
        return states, pooled

    def sampling_kwargs(self, prompt: Encoded, negative: Encoded | None, guidance_rescale: float) -> dict[str, Any]:
        """Classifier-free guidance against the negative prompt, or against zeros: the null condition trained on
        (models/diffusion.drop_condition)."""
        import torch

        states, pooled = prompt
        if negative is None:
            negative = torch.zeros_like(states), torch.zeros_like(pooled)
        return {"prompt_embeds": states, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": negative[0],
                "negative_pooled_prompt_embeds": negative[1]}


Family = type[UNet] | type[Flux] | type[SD3]
FAMILIES: dict[str, Family] = {"unet": UNet, "flux": Flux, "sd3": SD3}


def backbone_of(model: Model) -> Backbone:
    """The model option's network family."""
    family = FAMILIES.get(str(model.backbone))
    if family is None:
        raise ConfigError("model.backbone", f"unknown network family {model.backbone!r}",
                          "model.backbone=unet (model=sdxl, sd15, ...), flux (model=flux) or sd3 (model=sd35_large)")
    return family(model)


def family_of_class(class_name: str | None) -> Family:
    """The family a saved config's `_class_name` is of (a checkpoint's config.json; none: a U-Net's, as older
    checkpoints hold)."""
    for family in FAMILIES.values():
        if family.class_name == (class_name or UNet.class_name):
            return family
    raise ValueError(f"{class_name!r} is no network zerotune trains ({', '.join(f.class_name for f in FAMILIES.values())})")


def is_transformer(model: Model) -> bool:
    return issubclass(FAMILIES.get(str(model.backbone), UNet), _Transformer)

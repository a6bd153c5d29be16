"""The VAE's and text encoders' architectures: the components' own config.json when model.components (or
model.vae, ...) names local folders; otherwise the published configs for model=sdxl (SDXL base 1.0), sd15 and
sd21, and tests/helpers/tiny_components.py's for model=sdxl_tiny and sd15_tiny (their conf/model/ files describe
the same sets). The planner traces them (plan/encoders.py); model_stats counts the text encoders a run trains."""

from __future__ import annotations

import json
from pathlib import Path

from zerotune.schema import Model

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

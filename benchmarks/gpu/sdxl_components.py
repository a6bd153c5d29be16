"""SDXL 1.0's frozen components at full size with random weights, saved as a model.components folder: what the
latent-caching phase holds on the GPU (VAE 83.7M, CLIP ViT-L text encoder 123M, OpenCLIP bigG 695M parameters:
about 3.4 GiB in fp32), without downloading anything. The tokenizers are the test suite's small byte-level BPE
(tests/helpers/tiny_components.py): token ids differ from SDXL's, memory does not.
"""

from __future__ import annotations

from pathlib import Path

import torch

MAX_LEN = 77


def save_sdxl_vae(folder: Path) -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                  up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                  layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=1024,
                  scaling_factor=0.13025).save_pretrained(folder)


def save_sdxl_text_encoders(root: Path, tok) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    common = dict(vocab_size=49408, max_position_embeddings=MAX_LEN, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu", **common)
                  ).save_pretrained(root / "text_encoder")
    CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                               num_attention_heads=20, projection_dim=1280, hidden_act="gelu",
                                               **common)).save_pretrained(root / "text_encoder_2")


def save_sdxl_pipeline(root: Path) -> Path:
    """root/{vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2}, SDXL's shapes (cross-attention 2048,
    pooled 1280): what model=sdxl data=folder model.components=root reads."""
    from tests.helpers.tiny_components import save_tokenizer

    tok = save_tokenizer(root / "tokenizer")
    save_tokenizer(root / "tokenizer_2")
    save_sdxl_vae(root / "vae")
    save_sdxl_text_encoders(root, tok)
    return root

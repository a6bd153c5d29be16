"""Tiny random SDXL and SD 1.5 components matching conf/model/sdxl_tiny.yaml and sd15_tiny.yaml, saved as local
pipeline folders.

Nothing is downloaded: the tokenizer is built from a vocab.json + merges.txt written here (CLIP's
byte-level alphabet plus a few merges), the models from configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TE1_HIDDEN, TE2_HIDDEN, POOLED = 32, 64, 64  # 32 + 64 = the tiny U-Net's cross_attention_dim 96
WORDS = ("dog", "cat", "red", "blue", "photo", "of", "a")


def _byte_alphabet() -> list[str]:
    """CLIP's (GPT-2's) printable stand-ins for the 256 byte values."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def write_tokenizer_files(folder: Path) -> None:
    """vocab.json and merges.txt of a small byte-level BPE: every word splits into known pieces."""
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = _byte_alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)})
    merges = []
    for word in WORDS:  # merge left to right: "d o", "do g</w>"
        pieces = [*word[:-1], word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append(f"{pieces[0]} {pieces[1]}")
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
            vocab.setdefault(pieces[0], len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")


def save_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    write_tokenizer_files(folder)
    tok = CLIPTokenizer.from_pretrained(folder, local_files_only=True, model_max_length=77)
    tok.save_pretrained(folder)
    return tok


def save_vae(folder: Path, seed: int = 0) -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
                  up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[8, 16, 16], layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=64).save_pretrained(folder)


def save_text_encoders(root: Path, tok, seed: int = 0) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    common = dict(vocab_size=len(tok), max_position_embeddings=77, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=37, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    CLIPTextModel(CLIPTextConfig(hidden_size=TE1_HIDDEN, **common)).save_pretrained(root / "text_encoder")
    CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=TE2_HIDDEN, projection_dim=POOLED, **common)
                                ).save_pretrained(root / "text_encoder_2")


def save_tiny_pipeline(root: Path) -> Path:
    """root/{vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2}: a model.components folder."""
    tok = save_tokenizer(root / "tokenizer")
    save_tokenizer(root / "tokenizer_2")
    save_vae(root / "vae")
    save_text_encoders(root, tok)
    return root


def save_tiny_sd15_pipeline(root: Path) -> Path:
    """root/{vae, text_encoder, tokenizer}: an SD-1.5-shaped model.components folder for model=sd15_tiny (one
    CLIPTextModel of hidden size 32 = the U-Net's cross_attention_dim)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    tok = save_tokenizer(root / "tokenizer")
    save_vae(root / "vae")
    torch.manual_seed(1)
    CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), max_position_embeddings=77, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=37, hidden_size=TE1_HIDDEN,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(root / "text_encoder")
    return root

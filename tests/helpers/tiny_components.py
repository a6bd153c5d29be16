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


def save_tokenizer(folder: Path, max_length: int = 77):
    from transformers import CLIPTokenizer

    write_tokenizer_files(folder)
    tok = CLIPTokenizer.from_pretrained(folder, local_files_only=True, model_max_length=max_length)
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


def t5_tokenizer(words: int = 64):
    """A T5TokenizerFast over a Unigram vocabulary built here, as T5's own is (its sentencepiece model cannot be
    fetched): a piece per word, the pipelines padding to max_sequence_length; it saves and loads as T5's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = ["<pad>", "</s>", "<unk>", *(f"\u2581w{i}" for i in range(words)),
              *(f"\u2581{w}" for w in ("a", "photo", "of", "cat", "dog", "red", "blue"))]
    tok = Tokenizer(models.Unigram([(p, 0.0 if i < 3 else -1.0) for i, p in enumerate(pieces)], unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return T5TokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                           model_max_length=512)


def _t5(vocab_size: int, width: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=width, d_kv=8, d_ff=37, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0)).eval()  # as from_pretrained leaves it: no dropout


def _clip(tok, hidden: int, seed: int, projection: int | None = None):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tok), max_position_embeddings=77, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=37, hidden_size=hidden, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            **({"projection_dim": projection} if projection else {}))
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)).eval()


def _flow_vae(seed: int = 0):
    """A 4x VAE into 4 channels with a shift, as FLUX's and SD3's VAEs have one (their pipelines read it)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
                         up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[8, 16, 16], layers_per_block=1,
                         latent_channels=4, norm_num_groups=8, sample_size=64, scaling_factor=0.3611,
                         shift_factor=0.1159).eval()


def tiny_flux_pipeline(root: Path, transformer, scheduler: dict):
    """FluxPipeline around `transformer` (flux_tiny's shapes): a CLIP whose pooled output is its 32 wide hidden
    state, a T5 of width 32 (joint_attention_dim), the 4x VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    tok = save_tokenizer(root / "tokenizer")
    t5_tok = t5_tokenizer()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**scheduler), vae=_flow_vae(),
                        text_encoder=_clip(tok, 32, 1), tokenizer=tok, text_encoder_2=_t5(len(t5_tok), 32, 2),
                        tokenizer_2=t5_tok, transformer=transformer)


def tiny_sd3_pipeline(root: Path, transformer, scheduler: dict):
    """StableDiffusion3Pipeline around `transformer` (sd3_tiny's shapes): two CLIPs of width 16 with 32-wide
    projections (the pooled 64), padding captions to 8 tokens (model.clip_tokens), a T5 of width 32
    (joint_attention_dim; the CLIPs' 16 + 16 padded to it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    tok = save_tokenizer(root / "tokenizer", max_length=8)
    t5_tok = t5_tokenizer()
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
                                    vae=_flow_vae(), text_encoder=_clip(tok, 16, 1, 32), tokenizer=tok,
                                    text_encoder_2=_clip(tok, 16, 2, 32), tokenizer_2=tok,
                                    text_encoder_3=_t5(len(t5_tok), 32, 3), tokenizer_3=t5_tok)


def save_tiny_transformer_components(root: Path, family: str, scheduler: dict) -> Path:
    """root/{scheduler, vae, text_encoder, tokenizer, ...}: flux_tiny's (family "flux") or sd3_tiny's ("sd3") frozen
    parts and `scheduler` (the model option's), a model.components folder (no transformer: the run builds or loads
    its own)."""
    make = tiny_flux_pipeline if family == "flux" else tiny_sd3_pipeline
    make(root, None, scheduler).save_pretrained(root)
    return root

"""Shuffled captions: cache a few variants per caption, or encode every step's captions with the frozen encoders?

Times, on this machine, one step's text condition both ways for SDXL (CLIP ViT-L and OpenCLIP ViT-bigG text models
at their real sizes, random weights, fp32 as FrozenEncoders runs them): encoding a micro batch of captions, and
reading the same number of cached entries (data/latent_cache.py). Prints the encoders' weights, which encoding at
every step would keep on the device beside the U-Net (caching releases them before training). GPU time and memory
are not measured here (no card): those figures are the weights' bytes, and this CPU's timings.

    python benchmarks/bench_caption_encoding.py [--batch 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from zerotune.data.latent_cache import LatentCache
    from zerotune.models.text_encoders import SDXL, build

    torch.manual_seed(0)
    encoders = [build(name, SDXL[name]).eval() for name in ("text_encoder", "text_encoder_2")]
    weights = sum(p.numel() for e in encoders for p in e.parameters())
    ids = torch.randint(0, 49408, (args.batch, 77))

    def encode() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([e(ids, output_hidden_states=True).hidden_states[-2] for e in encoders], dim=-1)

    encode()  # warm-up
    encode_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        states = encode()
        encode_s.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as root:
        cache = LatentCache(Path(root))
        keys = [f"{i:064x}" for i in range(args.batch)]
        cache.put_texts(keys, [""] * args.batch, states, torch.randn(args.batch, 1280))
        read_s = []
        for _ in range(args.steps):
            start = time.perf_counter()
            for key in keys:
                cache.get_text(key)
            read_s.append(time.perf_counter() - start)
        entry = sum(p.stat().st_size for p in Path(root).rglob("*.safetensors")) / args.batch
    enc, read = statistics.median(encode_s), statistics.median(read_s)
    print(f"SDXL's two text encoders: {weights:,} parameters, {weights * 4 / 2**20:,.0f} MiB in fp32 "
          f"({weights * 2 / 2**20:,.0f} MiB in bf16) held beside the U-Net when encoding every step")
    print(f"one step's condition, {args.batch} captions, median of {args.steps} on this CPU "
          f"({torch.get_num_threads()} threads):")
    print(f"  encoded by the frozen encoders: {enc:.3f} s")
    print(f"  read from the cache:            {read:.4f} s  ({enc / read:,.0f}x faster)")
    print(f"  one cached entry: {entry / 2**10:,.0f} KiB on disk; data.caption_variants=4 keeps 4 per caption")


if __name__ == "__main__":
    main()

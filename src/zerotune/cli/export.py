"""`zerotune export <checkpoint> <out>` (and `python -m zerotune export`): the command; the work is
zerotune/export/."""

from __future__ import annotations

import argparse
import json

from zerotune.rundir import export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerotune export", description=(export.__doc__ or "").splitlines()[0])
    parser.add_argument("checkpoint", help="a step-NNNNNNN checkpoint folder, a checkpoint dir or a run dir")
    parser.add_argument("out", help="folder to write unet/, unet.safetensors (and unet_ema*) into (a diffusion "
                        "transformer's: transformer/, transformer.safetensors); with an adapter, "
                        "lora/pytorch_lora_weights.safetensors (and lora_ema/)")
    parser.add_argument("--merge", action="store_true", help="with an adapter: also write the network with the "
                        "adapter merged into its weights, as unet/ or transformer/ and its .safetensors")
    args = parser.parse_args(argv)
    written = export.export(args.checkpoint, args.out, merge=args.merge)
    print(json.dumps(written, indent=2))
    return 0

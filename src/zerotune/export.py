"""Export a checkpoint's weights: `python -m zerotune.export <checkpoint> <out>`.

Writes full fp32 weights, whatever ZeRO stage saved them (ZeRO-1/2/3 partitions are consolidated with
DeepSpeed's zero_to_fp32), as a diffusers folder and a .safetensors file:

    <out>/unet/                 UNet2DConditionModel.from_pretrained(<out>/unet)
    <out>/unet.safetensors
    <out>/unet_ema/, <out>/unet_ema.safetensors   when the run kept an EMA

`model.pretrained=<out>` starts a new run from <out>/unet. <checkpoint> may also be a run dir or a
checkpoint dir: the newest complete checkpoint in it is exported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from zerotune import checkpoints
from zerotune.checkpoints import manifest
from zerotune.training.checkpoint import full_state


def find_checkpoint(path: str | Path) -> Path:
    found = checkpoints.find(Path(path))
    if found is None:
        raise SystemExit(f"zerotune.export: {path} is not a complete checkpoint and holds none")
    damaged = manifest.problems(found)
    if damaged:
        raise SystemExit(f"zerotune.export: checkpoint {found} is damaged: {'; '.join(damaged[:3])}")
    return found


def _save(unet_config: dict, weights: dict, out: Path, name: str) -> Path:
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file

    unet = UNet2DConditionModel.from_config(unet_config)
    unet.load_state_dict(weights, strict=True)
    unet.save_pretrained(out / name, safe_serialization=True)
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(out / f"{name}.safetensors"))
    return out / name


def export(checkpoint: str | Path, out: str | Path) -> dict:
    path, out = find_checkpoint(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = checkpoints.unet_config(path)
    weights, _, _ = full_state(path, with_optimizer=False)
    written = {"checkpoint": str(path), "unet": str(_save(config, {k: v.float() for k, v in weights.items()},
                                                             out, "unet"))}
    if (path / checkpoints.EMA_FILE).is_file():
        ema = torch.load(path / checkpoints.EMA_FILE, map_location="cpu", weights_only=True)
        written["unet_ema"] = str(_save(config, ema["shadow"], out, "unet_ema"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerotune.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step-NNNNNNN checkpoint folder, a checkpoint dir or a run dir")
    parser.add_argument("out", help="folder to write unet/, unet.safetensors (and unet_ema*) into")
    args = parser.parse_args(argv)
    written = export(args.checkpoint, args.out)
    print(json.dumps(written, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

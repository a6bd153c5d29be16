"""The validation demo's data and components, on a CPU in about a minute (run.sh calls it).

- <out>/shapes/: 64x64 images of a red, green or blue circle, square or triangle at random places and sizes, each
  with its caption ("a red circle") in a side-car .txt;
- <out>/components/: tiny SDXL components (conf/model/sdxl_tiny.yaml's shapes, tests/helpers/tiny_components.py),
  whose VAE is then trained here to reconstruct the shapes, so that its decoder draws them. Its scaling factor is
  set to 1 / the std of its latents, as SD's VAEs' factors are.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests/helpers/tiny_components.py

from tests.helpers.tiny_components import save_tiny_pipeline  # noqa: E402

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")
SIZE = 64


def draw(shape: str, colour: str, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    pen = ImageDraw.Draw(image)
    r = rng.randint(12, 22)
    cx, cy = rng.randint(r + 2, SIZE - r - 2), rng.randint(r + 2, SIZE - r - 2)
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def make_shapes(folder: Path, per_caption: int, seed: int) -> list[Path]:
    rng, paths = random.Random(seed), []
    folder.mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        for shape in SHAPES:
            for i in range(per_caption):
                path = folder / f"{colour}_{shape}_{i:03d}.png"
                draw(shape, colour, rng).save(path)
                path.with_suffix(".txt").write_text(f"a {colour} {shape}\n")
                paths.append(path)
    return paths


def train_vae(folder: Path, images: list[Path], steps: int, seed: int) -> dict:
    """Reconstruction (MSE) with a small KL term, Adam, batch 32: the tiny VAE learns to draw flat shapes."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL.from_pretrained(folder)
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
                          for p in images])
    opt = torch.optim.Adam(vae.parameters(), lr=2e-3)
    for step in range(steps):
        batch = pixels[torch.randint(len(pixels), (32,))]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample()).sample
        loss = torch.nn.functional.mse_loss(recon, batch) + 1e-6 * posterior.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"vae step {step}: loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        std = float(torch.cat([vae.encode(pixels[i:i + 64]).latent_dist.mean for i in range(0, len(pixels), 64)]).std())
    vae.register_to_config(scaling_factor=1.0 / std)
    vae.save_pretrained(folder)
    return {"vae_steps": steps, "vae_final_loss": round(loss.item(), 5), "latent_std": round(std, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--per-caption", type=int, default=24)
    parser.add_argument("--vae-steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    images = make_shapes(args.out / "shapes", args.per_caption, args.seed)
    save_tiny_pipeline(args.out / "components")
    record = train_vae(args.out / "components" / "vae", images, args.vae_steps, args.seed)
    (args.out / "components.json").write_text(json.dumps({"images": len(images), **record}, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()

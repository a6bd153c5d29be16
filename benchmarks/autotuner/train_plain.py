"""A plain DeepSpeed training script for DeepSpeed's own autotuner: no Hydra runner, no zerotune Trainer.

The model and data are zerotune's benchmark ones (model=sdxl_tiny data=synthetic resolution=64), built by
zerotune's own builders; DeepSpeed takes everything else from --deepspeed_config, which the autotuner
replaces per experiment (micro batch, gradient accumulation, ZeRO stage and buckets).

    deepspeed --autotuning tune train_plain.py --deepspeed_config ds_config.json

(ds_config.json's "auto" micro batch is for the autotuner only; a plain run needs a concrete config, such as
the ds_config_optimal.json the autotuner writes.)
"""

from __future__ import annotations

import argparse
import time

import deepspeed
import torch

from zerotune.config.compose import compose
from zerotune.data import build_loader
from zerotune.data.spec import DataSpec
from zerotune.models import build_network
from zerotune.models.diffusion import diffusion_loss, noise_scheduler, unet_kwargs

OVERRIDES = ["model=sdxl_tiny", "data=synthetic", "resolution=64"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (the autotuner stops earlier)")
    parser.add_argument("--seed", type=int, default=0)
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    return parser.parse_args()


def batches(loader):
    """The loader's batches, over and over."""
    while True:
        yield from loader


def train(engine, cfg, steps: int, seed: int) -> None:
    """`steps` optimizer steps of the noise-prediction loss, each of gradient_accumulation_steps micro steps."""
    micro = engine.train_micro_batch_size_per_gpu()
    loader = build_loader(DataSpec(cfg.data, cfg.model, cfg.resolution.size, micro, seed), micro, seed)
    sched, gen = noise_scheduler(cfg.diffusion), torch.Generator().manual_seed(seed)
    kind, data = str(cfg.model.conditioning), batches(loader)
    start = time.perf_counter()
    for _ in range(steps * engine.gradient_accumulation_steps()):
        batch = next(data)
        loss = diffusion_loss(engine, batch["x0"], unet_kwargs(kind, batch), sched, gen, torch.float32)
        engine.backward(loss)
        engine.step()
    seconds = time.perf_counter() - start
    if engine.global_rank == 0:
        samples = steps * engine.train_batch_size()
        print(f"done: {steps} steps, micro batch {micro}, gas {engine.gradient_accumulation_steps()}, "
              f"zero stage {engine.zero_optimization_stage()}, loss {loss.item():.4f}, "
              f"{samples / seconds:.1f} samples/s over {seconds:.1f} s", flush=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    cfg = compose(OVERRIDES)
    unet = build_network(cfg.model)
    unet.train()
    engine, _, _, _ = deepspeed.initialize(args=args, model=unet, model_parameters=unet.parameters())
    train(engine, cfg, args.steps, args.seed)


if __name__ == "__main__":
    main()

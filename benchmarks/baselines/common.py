"""What both hand-written baselines share: the same work as a zerotune job, read from its run directory.

The work is the model, its initial weights, the data and its order, the noise draws and the loss: zerotune's
own building blocks, called directly. What the baselines leave out is everything around them (Hydra, the
launcher parent, checks, telemetry, metrics files, progress), which is the overhead being measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from zerotune.host.timing import process_start_time

WARMUP_STEPS = 5  # left out of the step-time median, as zerotune's train/run.py does


def parse_args(description: str) -> argparse.Namespace:
    """Both baselines take the zerotune run directory to copy, and the number of steps."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=200)
    return parser.parse_args()


def load_job(run_dir: str):
    """The job's effective config and the DeepSpeed dict zerotune wrote for it."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    ds = json.loads((Path(run_dir) / "ds_config.json").read_text())
    return cfg, ds


def build_work(cfg, micro_batch: int):
    """Seeded exactly as zerotune's Trainer does: seed, model, loader, noise schedule, draw generator."""
    import torch
    from accelerate.utils import set_seed

    from zerotune.data import build_loader
    from zerotune.data.spec import DataSpec
    from zerotune.models import build_network
    from zerotune.models.diffusion import noise_scheduler

    seed = int(cfg.train.seed)
    set_seed(seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    schedule = noise_scheduler(cfg.diffusion)
    generator = torch.Generator().manual_seed(seed * 7919)
    unet = build_network(cfg.model)
    loader = build_loader(DataSpec.from_config(cfg), micro_batch, seed)
    return unet, loader, schedule, generator


def loss_of(unet, batch: dict, cfg, schedule, generator, rank: int, world: int):
    """The diffusion loss of one micro batch, with this rank's slice of the global batch's draws."""
    device, dtype = next(unet.parameters()).device, next(unet.parameters()).dtype
    batch = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in batch.items()}
    from zerotune.models import diffusion
    from zerotune.models.diffusion import diffusion_loss
    from zerotune.train.distributed import global_batch_draws

    kind, p = cfg.model.conditioning, float(cfg.diffusion.cond_dropout)
    draws = global_batch_draws(generator, tuple(batch["x0"].shape), rank, world,
                               schedule.config.num_train_timesteps, p)
    cond = diffusion.drop_condition(kind, batch, p, generator, uniform=draws["uniform"])
    return diffusion_loss(unet, batch["x0"], diffusion.unet_kwargs(kind, cond), schedule, generator, dtype,
                          noise=draws["noise"], timesteps=draws["timesteps"])


class Clock:
    """Per-step durations (after device sync) and the wall time the first step ended."""

    def __init__(self, device) -> None:
        import torch

        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.durations: list[float] = []
        self.first_step_end_unix: float | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.sync()
        self.durations.append(time.perf_counter() - self._t0)
        if self.first_step_end_unix is None:
            self.first_step_end_unix = time.time()


def report(clock: Clock, first_loss: float, steps: int, rank: int) -> None:
    """Rank 0 prints one JSON line, the last of its output, for benchmarks/bench_vs_baselines.py."""
    if rank != 0:
        return
    import torch

    timed = clock.durations[WARMUP_STEPS:]
    print(json.dumps({"first_loss": first_loss, "steps": steps,
                      "step_time_median_s": statistics.median(timed) if timed else None,
                      "first_step_end_unix": clock.first_step_end_unix,
                      "process_start_unix": process_start_time(),
                      "threads": torch.get_num_threads()}), flush=True)


def lone_process_env() -> None:
    """A process started without a launcher is rank 0 of 1, as torchrun would describe it (DeepSpeed
    otherwise looks for MPI)."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29731"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

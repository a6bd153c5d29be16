"""The training objective: DDPM forward noising and the noise- (or v-) prediction loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler


def noise_scheduler(diff: Any) -> DDPMScheduler:
    return DDPMScheduler(num_train_timesteps=int(diff.num_train_timesteps), beta_schedule=str(diff.beta_schedule),
                         beta_start=float(diff.beta_start), beta_end=float(diff.beta_end),
                         prediction_type=str(diff.prediction_type))


def diffusion_loss(unet, x0: torch.Tensor, cond: dict, sched: DDPMScheduler, generator: torch.Generator,
                   dtype: torch.dtype, noise: torch.Tensor | None = None,
                   timesteps: torch.Tensor | None = None) -> torch.Tensor:
    """MSE between the U-Net's prediction and its target at a random timestep, computed in fp32.

    Noise and timesteps are drawn on the CPU from `generator`, so runs are reproducible on any device,
    unless given (drawn for the global batch and sliced per rank: see training/distributed.py).
    """
    n = x0.shape[0]
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator)
    if timesteps is None:
        timesteps = torch.randint(0, sched.config.num_train_timesteps, (n,), generator=generator)
    noise, t = noise.to(x0.device, x0.dtype), timesteps.to(x0.device)
    noisy = sched.add_noise(x0, noise, t)
    if sched.config.prediction_type == "v_prediction":
        target = sched.get_velocity(x0, noise, t)
    else:
        target = noise
    pred = unet(noisy.to(dtype), t, **cond).sample
    return F.mse_loss(pred.float(), target.float())

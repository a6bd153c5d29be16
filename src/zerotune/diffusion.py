"""The training objective: DDPM forward noising and the noise- (or v-) prediction loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

from zerotune.schema import Diffusion


def noise_scheduler(diff: Diffusion) -> DDPMScheduler:
    """The training schedule. `rescale_betas_zero_snr` is diffusers' own rescaling (Lin et al. 2023, Algorithm 1):
    the last timestep's signal-to-noise ratio becomes exactly 0."""
    return DDPMScheduler(num_train_timesteps=int(diff.num_train_timesteps), beta_schedule=str(diff.beta_schedule),
                         beta_start=float(diff.beta_start), beta_end=float(diff.beta_end),
                         prediction_type=str(diff.prediction_type),
                         rescale_betas_zero_snr=diff.rescale_betas_zero_snr)


def min_snr_weights(sched: DDPMScheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """Min-SNR-γ (Hang et al. 2023) per-sample loss weights, as diffusers' text-to-image examples weight them:
    min(SNR, γ)/SNR for an epsilon target, min(SNR, γ)/(SNR + 1) for a v target."""
    from diffusers.training_utils import compute_snr

    snr = compute_snr(sched, timesteps)
    clipped = torch.clamp(snr, max=gamma)
    if sched.config.prediction_type == "v_prediction":
        return clipped / (snr + 1)
    return clipped / snr


def diffusion_loss(unet, x0: torch.Tensor, cond: dict, sched: DDPMScheduler, generator: torch.Generator,
                   dtype: torch.dtype, noise: torch.Tensor | None = None,
                   timesteps: torch.Tensor | None = None, min_snr_gamma: float | None = None) -> torch.Tensor:
    """MSE between the U-Net's prediction and its target at a random timestep, computed in fp32; with
    `min_snr_gamma`, each sample's MSE weighted by min_snr_weights.

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
    if min_snr_gamma is None:
        return F.mse_loss(pred.float(), target.float())
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))
    return (per_sample * min_snr_weights(sched, t, min_snr_gamma)).mean()

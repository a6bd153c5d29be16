"""Class-conditional sampling with classifier-free guidance for U-Nets trained with a DDPM schedule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers import DPMSolverMultistepScheduler

from zerotune.models.conditioning import NULL_CLASS, unet_kwargs


def make_sampler(
    noise_scheduler_config: Mapping[str, Any], prediction_type: str, pixel_space: bool = True
) -> DPMSolverMultistepScheduler:
    """DPM-Solver++ (2nd order, multistep) sharing the training betas; good samples in ~20 steps.

    In pixel space the predicted clean image is clipped to [-1, 1] at every step (thresholding with a max of 1).
    Without that an epsilon model is unusable on squaredcos_cap_v2: alpha_bar at t=999 is ~2e-9, so the first
    x0 = (x - sigma * eps) / alpha multiplies any eps error by ~2e4 and samples saturate to noise. Latents
    (pixel_space=False) have no such range, and are left unclipped, as diffusers' SDXL pipelines leave them.
    """
    config = dict(noise_scheduler_config)
    config.pop("variance_type", None)  # a DDPM-only setting ("fixed_small" is no DPM-Solver variance type)
    # Lin et al. 2023: with zero terminal SNR, sampling must start at the last timestep (trailing spacing). A
    # keyword: from_config drops the keys the training schedule holds at their defaults (`_use_default_values`).
    spacing = {"timestep_spacing": "trailing"} if config.get("rescale_betas_zero_snr") else {}
    return DPMSolverMultistepScheduler.from_config(
        config,
        **spacing,
        prediction_type=prediction_type,
        algorithm_type="dpmsolver++",
        solver_order=2,
        thresholding=pixel_space,
        sample_max_value=1.0,
    )


def _per_image(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    if len(shape) == 4:
        if shape[0] != n:
            raise ValueError(f"shape {shape} does not match {n} class labels")
        return tuple(shape[1:])
    return tuple(shape)


@torch.no_grad()
def sample_images(
    unet: torch.nn.Module,
    noise_scheduler_config: Mapping[str, Any],
    class_labels: torch.Tensor,
    shape: tuple[int, ...],
    num_inference_steps: int,
    guidance_scale: float,
    generator: torch.Generator,
    prediction_type: str,
) -> torch.Tensor:
    """Generate one image per entry of `class_labels`; returns float32 [N, C, H, W] clamped to [-1, 1].

    `shape` is the per-image (C, H, W) (a full (N, C, H, W) is accepted too). The initial noise is
    drawn on `generator`'s device, so a fixed generator seed gives the same images on any device.
    The conditional and NULL_CLASS halves run as one batch; guidance_scale 1 means no guidance.
    """
    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"unsupported prediction_type {prediction_type!r}")
    n = len(class_labels)
    shape = _per_image(shape, n)
    param = next(unet.parameters())
    device, dtype = param.device, param.dtype

    scheduler = make_sampler(noise_scheduler_config, prediction_type)
    scheduler.set_timesteps(num_inference_steps, device=device)
    x = torch.randn((n, *shape), generator=generator, device=generator.device, dtype=torch.float32)
    x = x.to(device) * scheduler.init_noise_sigma

    labels = class_labels.to(device=device, dtype=torch.long)
    cfg_labels = torch.cat([labels, torch.full_like(labels, NULL_CLASS)])
    was_training = unet.training
    unet.eval()
    try:
        for t in scheduler.timesteps:
            x = _guided_step(unet, scheduler, x, t, cfg_labels, guidance_scale, dtype)
    finally:
        unet.train(was_training)
    return x.clamp(-1, 1)


def _guided_step(unet, scheduler, x: torch.Tensor, t, cfg_labels: torch.Tensor, guidance_scale: float, dtype):
    """One denoising step; the conditional and NULL_CLASS halves run as one batch."""
    model_in = scheduler.scale_model_input(torch.cat([x, x]), t).to(dtype)
    kwargs = unet_kwargs("class", {"class_labels": cfg_labels})
    cond, uncond = unet(model_in, t.expand(model_in.shape[0]), **kwargs).sample.float().chunk(2)
    # Guidance is linear in the prediction, so it is the same for epsilon and v targets.
    return scheduler.step(uncond + guidance_scale * (cond - uncond), t, x).prev_sample

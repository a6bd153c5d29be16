"""Diffusion: the training objectives (DDPM noising with the noise- or v-prediction loss here; flow matching in
flow_matching.py), how a batch conditions the network and drops its condition, and class-conditional sampling with
classifier-free guidance. diffusers is imported where a schedule is made: the job's planner reads the conditioning
rules here without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from zerotune.config.schema import Diffusion, Model
from zerotune.models.flow_matching import FlowMatching, Predict

if TYPE_CHECKING:
    from diffusers import DDPMScheduler, DPMSolverMultistepScheduler


def noise_scheduler(diff: Diffusion) -> DDPMScheduler:
    """The training schedule. `rescale_betas_zero_snr` is diffusers' own rescaling (Lin et al. 2023, Algorithm 1):
    the last timestep's signal-to-noise ratio becomes exactly 0."""
    from diffusers import DDPMScheduler

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


class Objective(Protocol):
    """What the trainer asks of a training objective: timesteps for the global batch, and the loss."""

    def draw_timesteps(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """`n` draws from `generator`: what `loss` takes as its `timesteps` (DDPM's timesteps; flow matching's
        indices into its schedule)."""

    def loss(self, predict: Predict, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """The loss in fp32; `predict(noisy, t)`: the network's output for noisy latents at the schedule's t;
        `mask`: [B, 1, h, w] weights of each latent pixel (data.masked_loss)."""


@dataclass(frozen=True)
class NoisePrediction:
    """DDPM's objective: noise (epsilon) or velocity (v) prediction, optionally Min-SNR-γ weighted."""

    schedule: DDPMScheduler
    min_snr_gamma: float | None = None
    timestep_range: Sequence[int] | None = None  # [first, last], inclusive

    def draw_timesteps(self, n: int, generator: torch.Generator) -> torch.Tensor:
        first, last = self.timestep_range if self.timestep_range is not None else (
            0, self.schedule.config.num_train_timesteps - 1)  # type: ignore[attr-defined]
        return torch.randint(first, last + 1, (n,), generator=generator)

    def loss(self, predict: Predict, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        noise, t = noise.to(x0.device, x0.dtype), timesteps.to(x0.device)
        noisy = self.schedule.add_noise(x0, noise, t)
        if self.schedule.config.prediction_type == "v_prediction":  # type: ignore[attr-defined]
            target = self.schedule.get_velocity(x0, noise, t)
        else:
            target = noise
        pred = predict(noisy, t)
        if self.min_snr_gamma is None and mask is None:
            return F.mse_loss(pred.float(), target.float())
        squared = masked(F.mse_loss(pred.float(), target.float(), reduction="none"), mask)
        per_sample = squared.mean(dim=tuple(range(1, pred.ndim)))
        if self.min_snr_gamma is None:
            return per_sample.mean()
        return (per_sample * min_snr_weights(self.schedule, t, self.min_snr_gamma)).mean()


def masked(loss: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The per-element loss [B, C, h, w] times the mask [B, 1, h, w] (every channel alike), as kohya's
    apply_masked_loss: the mean is then taken over every element, masked ones included (not renormalised)."""
    return loss if mask is None else loss * mask.to(loss.device, loss.dtype)


def objective_of(model: Model, diff: Diffusion) -> NoisePrediction | FlowMatching:
    """The model's objective: flow matching for a flow model (prediction_type flow_matching), DDPM's otherwise."""
    if diff.prediction_type == "flow_matching":
        return FlowMatching.of(model, diff)
    return NoisePrediction(noise_scheduler(diff), diff.min_snr_gamma,
                           tuple(diff.timestep_range) if diff.timestep_range is not None else None)


def diffusion_loss(unet, x0: torch.Tensor, cond: dict, sched: DDPMScheduler, generator: torch.Generator,
                   dtype: torch.dtype, noise: torch.Tensor | None = None,
                   timesteps: torch.Tensor | None = None, min_snr_gamma: float | None = None) -> torch.Tensor:
    """MSE between the U-Net's prediction and its target at a random timestep, in fp32 (with `min_snr_gamma`,
    weighted by min_snr_weights). Noise and timesteps, unless given (drawn for the global batch and sliced per
    rank), are drawn on the CPU from `generator`, so runs are reproducible on any device."""
    n = x0.shape[0]
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator)
    if timesteps is None:
        timesteps = torch.randint(0, sched.config.num_train_timesteps, (n,), generator=generator)
    objective = NoisePrediction(sched, min_snr_gamma)
    return objective.loss(lambda noisy, t: unet(noisy.to(dtype), t, **cond).sample, x0, noise, timesteps)


NULL_CLASS = 10  # the class index reserved for "no class" (classifier-free guidance)


def unet_kwargs(kind: str, batch: dict) -> dict:
    """Keyword arguments for unet(sample, timestep, **kwargs)."""
    if kind == "class":
        return {"encoder_hidden_states": None, "class_labels": batch["class_labels"]}
    if kind == "text":  # SD 1.x / 2.x: one text encoder's hidden states, nothing added
        return {"encoder_hidden_states": batch["encoder_hidden_states"]}
    if kind == "text_time":
        return {"encoder_hidden_states": batch["encoder_hidden_states"],
                "added_cond_kwargs": {"text_embeds": batch["text_embeds"], "time_ids": batch["time_ids"]}}
    if kind == "text_pooled":  # FLUX.1 / SD3: the token states and the pooled embedding (models/backbones.py)
        return {"encoder_hidden_states": batch["encoder_hidden_states"],
                "pooled_projections": batch["pooled_projections"]}
    raise ValueError(f"unknown conditioning kind {kind!r}")


def drop_condition(kind: str, batch: dict, prob: float, generator: torch.Generator,
                   uniform: torch.Tensor | None = None) -> dict:
    """Replace the condition by the null condition for a random `prob` share of the batch. `uniform`: the
    batch's U(0, 1) draws, if already drawn (for the global batch, sliced per rank)."""
    if prob <= 0:
        return batch
    keys = {"class": ("class_labels",), "text": ("encoder_hidden_states",),
            "text_time": ("encoder_hidden_states", "text_embeds"),
            "text_pooled": ("encoder_hidden_states", "pooled_projections")}[kind]
    n = batch[keys[0]].shape[0]
    drop = (torch.rand(n, generator=generator) if uniform is None else uniform) < prob
    out = dict(batch)
    for key in keys:
        value = batch[key]
        mask = drop.to(value.device).view(-1, *([1] * (value.dim() - 1)))
        null = torch.full_like(value, NULL_CLASS) if kind == "class" else torch.zeros_like(value)
        out[key] = torch.where(mask, null, value)
    return out


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
    from diffusers import DPMSolverMultistepScheduler

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
    """One image per entry of `class_labels`, float32 [N, C, H, W] clamped to [-1, 1]. `shape`: (C, H, W) (or
    (N, C, H, W)). The initial noise is drawn on `generator`'s device, so a fixed seed gives the same images on
    any device. guidance_scale 1 means no guidance."""
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

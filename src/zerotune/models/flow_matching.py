"""Flow matching (rectified flow), the objective FLUX.1 and SD3 train with, as diffusers' train_dreambooth_flux.py
and train_dreambooth_sd3.py define it: a timestep index drawn from the weighting scheme's density
(`compute_density_for_timestep_sampling`), the latents moved along the straight line to the noise,
x_t = (1 - sigma) x0 + sigma noise, and the network's velocity regressed on noise - x0, weighted by
`compute_loss_weighting_for_sd3`. The schedule is the model's FlowMatchEulerDiscreteScheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Diffusion, Model

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler

WEIGHTING_SCHEMES = ("none", "logit_normal", "mode", "cosmap", "sigma_sqrt")
Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (noisy latents, timesteps) -> the network's output


def flow_schedule(model: Model) -> FlowMatchEulerDiscreteScheduler:
    """The model's schedule (model.scheduler: the pipeline's scheduler config). With use_dynamic_shifting (FLUX.1)
    its training sigmas are the unshifted line; otherwise shifted by `shift` (SD3: 3.0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**dict(model.scheduler))


@dataclass(frozen=True)
class FlowMatching:
    schedule: FlowMatchEulerDiscreteScheduler
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False
    timestep_range: Sequence[int] | None = None  # [first, last]: timesteps (sigma x 1000) kept, inclusive

    @classmethod
    def of(cls, model: Model, diff: Diffusion) -> FlowMatching:
        return cls(flow_schedule(model), str(diff.weighting_scheme), float(diff.logit_mean), float(diff.logit_std),
                   float(diff.mode_scale), bool(diff.precondition_outputs),
                   tuple(diff.timestep_range) if diff.timestep_range is not None else None)

    def _window(self) -> tuple[int, int]:
        """(first index, how many) of the schedule's timesteps (descending, from pure noise) the run trains on."""
        timesteps = self.schedule.timesteps
        if self.timestep_range is None:
            return 0, len(timesteps)
        first, last = self.timestep_range
        kept = ((timesteps >= first) & (timesteps <= last)).nonzero().flatten()
        return int(kept[0]), len(kept)

    def draw_timesteps(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """`n` indices into the schedule, as the scripts draw them: u from the scheme's density, index u x N."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling(self.weighting_scheme, n, self.logit_mean, self.logit_std,
                                                  self.mode_scale, generator=generator)
        first, count = self._window()
        # sigmoid(N(0, 1)) rounds to 1.0 in float32 about once in 10^8 draws: index N would be past the end
        return first + (u * count).long().clamp(max=count - 1)

    def loss(self, predict: Predict, x0: torch.Tensor, noise: torch.Tensor, indices: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """The weighted flow-matching loss, in fp32, for latents `x0` and `noise` at the schedule's `indices`;
        `mask`: [B, 1, h, w] weights of each latent pixel (data.masked_loss)."""
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        noise, indices = noise.to(x0.device, x0.dtype), indices.to("cpu")
        sigmas = self.schedule.sigmas[indices].to(x0.device, x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
        timesteps = self.schedule.timesteps[indices].to(x0.device)
        noisy = (1.0 - sigmas) * x0 + sigmas * noise
        pred = predict(noisy, timesteps)
        if self.precondition_outputs:  # the predicted clean latents (EDM, section 5), against x0
            pred, target = pred * (-sigmas) + noisy, x0
        else:
            target = noise - x0
        weighting = compute_loss_weighting_for_sd3(self.weighting_scheme, sigmas)
        squared = weighting.float() * (pred.float() - target.float()) ** 2
        if mask is not None:  # as kohya's apply_masked_loss: weighted, then the mean over every element
            squared = squared * mask.to(squared.device, squared.dtype)
        per_sample = squared.reshape(x0.shape[0], -1).mean(1)
        return per_sample.mean()


def check(diff: Diffusion) -> None:
    """The objective's settings, against the objective: flow matching's own, and DDPM's that mean nothing here."""
    flow = diff.prediction_type == "flow_matching"
    if not flow:
        if diff.weighting_scheme != "none" or diff.precondition_outputs:
            key = "diffusion.weighting_scheme" if diff.weighting_scheme != "none" else "diffusion.precondition_outputs"
            raise ConfigError(key, f"is a flow-matching setting; this model is trained with {diff.prediction_type} "
                              "prediction (DDPM)", f"{key}={'none' if key.endswith('scheme') else 'false'}, or a flow "
                              "model: model=flux_tiny data=synthetic (or sd3_tiny, flux, sd35_large, sd35_medium)")
        return
    if diff.weighting_scheme not in WEIGHTING_SCHEMES:
        raise ConfigError("diffusion.weighting_scheme", f"unknown scheme {diff.weighting_scheme!r}",
                          "diffusion.weighting_scheme=" + " or ".join(WEIGHTING_SCHEMES))
    if not float(diff.logit_std) > 0:
        raise ConfigError("diffusion.logit_std", f"must be positive, got {diff.logit_std!r}", "diffusion.logit_std=1.0")
    # DDPM's: Min-SNR-γ weights by a DDPM schedule's SNR, zero terminal SNR rescales its betas
    if diff.min_snr_gamma is not None:
        raise ConfigError("diffusion.min_snr_gamma", "weights a DDPM schedule's signal-to-noise ratio; flow matching "
                          "weights its loss by diffusion.weighting_scheme", "diffusion.min_snr_gamma=null "
                          "diffusion.weighting_scheme=logit_normal (SD3's paper) or cosmap")
    if diff.rescale_betas_zero_snr:
        raise ConfigError("diffusion.rescale_betas_zero_snr", "rescales a DDPM schedule's betas; a flow schedule "
                          "already ends at pure noise (sigma 1)", "diffusion.rescale_betas_zero_snr=false")

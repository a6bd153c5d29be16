"""Sample a grid per class with the trained weights and score it with a classifier of real digits."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from zerotune.models import adapter, build_unet
from zerotune.quality import DigitClassifier, save_grid, save_samples
from zerotune.rundir import SAMPLES, RunDir
from zerotune.sampling import sample_images
from zerotune.schema import Config

if TYPE_CHECKING:
    from zerotune.training.trainer import Trainer

log = logging.getLogger(__name__)


def evaluate_digits(trainer: Trainer, cfg: Config, run_dir: RunDir) -> dict | None:
    """Accuracy of class-conditional samples, as judged by an SVC trained on the real digits."""
    use_ema = bool(cfg.ema.enabled and cfg.ema.use_for_samples)
    state = trainer.full_state_dict(use_ema)  # every rank: a collective under ZeRO-3
    if not trainer.accelerator.is_main_process:
        return None
    t0 = time.perf_counter()
    unet = adapter.add_adapter(build_unet(cfg.model), cfg.adapter).float()
    unet.load_state_dict(state)
    unet.eval()
    ev = cfg.evaluate
    labels = torch.arange(10).repeat_interleave(int(ev.per_class))
    schedule = dict(trainer.noise_schedule.config)  # type: ignore[attr-defined]  # diffusers' ConfigMixin
    images = sample_images(unet, schedule, labels, trainer.run.input_shape,
                           int(ev.steps), float(ev.guidance_scale), torch.Generator().manual_seed(cfg.train.seed),
                           cfg.diffusion.prediction_type)
    clf = DigitClassifier()
    grid, samples = run_dir.path / SAMPLES / "grid.png", run_dir.path / SAMPLES / "samples.npz"
    if run_dir.is_writer:
        save_grid(images, labels, grid, nrow=min(int(ev.per_class), 10))
        save_samples(images, labels, samples)  # the very tensors scored below
    result: dict[str, Any] = {"digit_accuracy": clf.accuracy(images, labels),
              "per_class_accuracy": {str(k): v for k, v in clf.per_class_accuracy(images, labels).items()},
              "samples": len(labels), "weights": "ema" if use_ema else "model",
              "sampling_s": time.perf_counter() - t0, "grid": str(grid.relative_to(run_dir.path)),
              "samples_file": str(samples.relative_to(run_dir.path))}
    log.info("digit accuracy %.1f%% over %d samples (%s weights)", 100 * result["digit_accuracy"], len(labels),
             result["weights"])
    return result

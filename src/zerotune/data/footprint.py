"""A lower bound on the host memory a job's input tensors take, checked before any worker starts: a
resolution whose inputs alone cannot fit this machine is refused with the estimate, not an allocation failure."""

from __future__ import annotations

import math

import psutil

from zerotune.data.spec import DataSpec
from zerotune.errors import ConfigError
from zerotune.models import downsample_factor, latent_shape
from zerotune.units import DTYPE_BYTES

DIGITS_IMAGES = 1797   # sklearn's digits: DigitsDataset holds every one, upsampled, in one tensor
GIB = 2**30


def input_bytes(spec: DataSpec) -> tuple[int, str]:
    """The bytes of input that must sit in memory at once, and what they are, in words."""
    channels, height, width = latent_shape(spec.model, spec.resolution)
    sample = channels * height * width * DTYPE_BYTES["fp32"]  # samples are float32 tensors
    each = f"{channels}x{height}x{width} float32, {sample / GIB:,.2f} GiB each"
    if spec.data.name == "digits":
        return DIGITS_IMAGES * sample, f"data=digits holds its {DIGITS_IMAGES} images upsampled ({each})"
    return spec.batch_size * sample, f"one micro batch of {spec.batch_size} inputs ({each})"


def check_fits_memory(spec: DataSpec, total: int | None = None) -> None:
    """Refuse a resolution whose input tensors alone exceed this machine's memory (`total` bytes; default:
    psutil's total). A lower bound: activations, weights and optimizer states come on top."""
    total = total or psutil.virtual_memory().total
    need, what = input_bytes(spec)
    if need <= total:
        return
    # Input bytes grow with size**2: the largest size that fits, rounded down to one the model takes.
    step = int(spec.model.vae_scale_factor) * downsample_factor(spec.model)
    largest = int(spec.resolution * math.sqrt(total / need)) // step * step
    fix = f"resolution.size={largest} or less" if largest > 0 else "a smaller model or resolution"
    if spec.data.name != "digits":
        fix += ", or a smaller train.batch_size"
    raise ConfigError("resolution.size", f"{spec.resolution} px needs at least {need / GIB:,.1f} GiB of memory "
                      f"for its inputs alone: {what}; this machine has {total / GIB:,.1f} GiB in all "
                      "(psutil.virtual_memory().total)", fix)

"""What the machine can do: which accelerator, whether DeepSpeed supports it, which precisions."""

from __future__ import annotations

import ctypes.util
import platform as _platform
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    device_type: str             # "cuda" | "cpu" | "mps"
    deepspeed_supported: bool
    deepspeed_reason: str        # why not, when not
    bf16: bool
    fp16: bool

    def supports(self, precision: str) -> bool:
        return {"fp32": True, "bf16": self.bf16, "fp16": self.fp16}[precision]


# A CUDA card that can do what a GPU can: configurations meant for a card (an imported file, a plan for a
# named GPU) are checked against it, not against the machine that reads them.
ANY_CUDA_GPU = Platform("cuda", True, "", bf16=True, fp16=True)


def _is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def cuda_device_present() -> bool:
    """Whether this torch sees a CUDA device, asked of NVML without starting CUDA's driver (a process that started
    it cannot fork a child that uses the card). A CUDA build on a host with no GPU (PyPI's default torch) is a
    CPU host. Where NVML cannot answer but the driver's library is installed, a device is assumed: a worker that
    cannot use its card costs more than one that starts slowly."""
    if not torch.cuda._is_compiled():
        return False
    count = torch.cuda._device_count_nvml()  # CUDA_VISIBLE_DEVICES applied; negative where NVML cannot answer
    if count >= 0:
        return count > 0
    return ctypes.util.find_library("cuda") is not None


def detect() -> Platform:
    """Inspect the running machine. DeepSpeed is CUDA- and CPU-only: MPS and ROCm builds are refused."""
    if sys.platform == "darwin" or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return Platform("mps", False, f"DeepSpeed does not support macOS/MPS ({_platform.platform()})",
                        bf16=False, fp16=True)
    if _is_rocm():
        return Platform("cuda", False, f"DeepSpeed is not supported on ROCm (torch {torch.__version__})",
                        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(), fp16=True)
    if torch.cuda.is_available():
        return Platform("cuda", True, "", bf16=torch.cuda.is_bf16_supported(), fp16=True)
    return Platform("cpu", True, "", bf16=True, fp16=_cpu_fp16_supported())


def _cpu_fp16_supported() -> bool:
    # DeepSpeed's CPU accelerator asks oneDNN the same question.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False

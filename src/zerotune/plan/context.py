"""What a CUDA process holds before its first tensor: the context (driver structures and the kernels
loaded so far) and cuBLAS's workspace. Since CUDA 11.7 torch loads kernels lazily
(CUDA_MODULE_LOADING=LAZY), which brought the context from over 600 MiB to a few hundred. Stated per
device family, each with its source; experiments/results/planner_reference.md has the details."""

from __future__ import annotations

from zerotune.units import MIB

CONTEXT: dict[str, dict] = {
    "ampere": {"bytes": 256 * MIB, "source": "RTX 3090, torch 2.7 (invoke-ai/InvokeAI#9413: a bare context, 256 MiB)"},
    "ada": {"bytes": 426 * MIB, "source": "RTX 6000 Ada, the 4090's chip (unslothai/unsloth-zoo PR #1053: 426 MiB)"},
    # Measured, and more than a bare context: what a DeepSpeed training process holds outside torch's allocator
    # (the context, NCCL's buffers, the kernels it loaded), which is what nvidia-smi adds to torch's figures.
    "hopper": {"bytes": 1324 * MIB, "source": "measured: nvidia-smi's process peak less torch's reserved peak, "
                                              "1,320-1,328 MiB in 12 DeepSpeed runs on an H100 and an H200 (torch "
                                              "2.11+cu130, NCCL 2.28; experiments/results/gpu/)"},
}

# cuBLAS workspace per handle (one per device and stream in use), allocated through torch's allocator:
# torch CublasHandlePool.cpp getChosenWorkspaceSize ":4096:2:16:8" = 8.125 MiB, 32 MiB from Hopper on;
# cuBLASLt adds 1 MiB (CUDABlas.cpp).
CUBLAS_WORKSPACE: dict[str, int] = {"ampere": int(8.125 * MIB) + MIB, "ada": int(8.125 * MIB) + MIB,
                                    "hopper": 32 * MIB + MIB}

"""The `env` part's probe, run in a fresh process (so no other CUDA context is on the card): versions, the GPU
memory nvidia-smi shows after each first use (CUDA context, cuBLAS, cuDNN, NCCL), DeepSpeed's ops (whether each
could JIT-build here and whether it is built already: ds_report's table, nothing built) and DeepSpeed's CPU-Adam
build time, into a JSON file. Without a GPU (--dry-run) the same steps run on the CPU and every GPU
figure is None. --no-build leaves CPU-Adam unbuilt: the `first` part's first row builds it (zerotune's launch
checks, timed in its summary.json), so the probe takes seconds.

    python benchmarks/gpu/env_probe.py OUT.json [--dry-run] [--no-build]   (DeepSpeed logs to stdout: the answer
                                                                             is a file)
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def smi(query: list[str]) -> list[list[str]] | None:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def smi_used(gpu: bool) -> dict:
    """The card's used memory and this process's, as nvidia-smi prints them (MiB)."""
    if not gpu:
        return {"smi_device_used_mib": None, "smi_process_used_mib": None}
    device = smi(["--query-gpu=memory.used"])
    apps = smi(["--query-compute-apps=pid,used_memory"]) or []
    mine = [float(used) for pid, used in apps if pid == str(os.getpid())]
    # In a container NVML may report host pids: then the only process on the card is taken as this one.
    process = mine[0] if mine else (float(apps[0][1]) if len(apps) == 1 else None)
    return {"smi_device_used_mib": float(device[0][0]) if device else None, "smi_process_used_mib": process}


def torch_used(gpu: bool) -> dict:
    import torch

    if not gpu:
        return {"torch_allocated_mib": None, "torch_reserved_mib": None}
    return {"torch_allocated_mib": torch.cuda.memory_allocated() / MIB,
            "torch_reserved_mib": torch.cuda.memory_reserved() / MIB}


def versions(gpu: bool) -> dict:
    import deepspeed
    import diffusers
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "deepspeed": deepspeed.__version__, "diffusers": diffusers.__version__, "gpu": None, "driver": None,
           "gpu_total_mib": None, "cudnn": None, "nccl": None}
    if gpu:
        rows = smi(["--query-gpu=name,driver_version,memory.total"])
        if rows:
            out.update(gpu=rows[0][0], driver=rows[0][1], gpu_total_mib=float(rows[0][2]))
        out["cudnn"] = torch.backends.cudnn.version()
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def first_uses(gpu: bool) -> list[dict]:
    """Memory after each first use, in order; each step adds to the one before."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda" if gpu else "cpu")
    n, c, hw = (4096, 320, 128) if gpu else (64, 8, 16)  # the CPU's turn only walks the same steps
    steps = [("before_cuda", lambda: None),
             ("after_zeros", lambda: torch.zeros(1, device=device)),
             ("after_bf16_matmul", lambda: torch.ones(n, n, device=device, dtype=torch.bfloat16) @
              torch.ones(n, n, device=device, dtype=torch.bfloat16)),
             ("after_conv", lambda: torch.nn.functional.conv2d(
                 torch.ones(1, c, hw, hw, device=device, dtype=torch.bfloat16),
                 torch.ones(c, c, 3, 3, device=device, dtype=torch.bfloat16), padding=1)),
             ("after_nccl_init", lambda: init_one_rank(dist, device, gpu))]
    rows = []
    for name, step in steps:
        started = time.perf_counter()
        step()
        if gpu:
            torch.cuda.synchronize()
        rows.append({"step": name, "seconds": round(time.perf_counter() - started, 3), **smi_used(gpu),
                     **torch_used(gpu)})
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


def init_one_rank(dist, device, gpu: bool) -> None:
    """A process group of one rank (NCCL on the card, gloo on the CPU), and one all-reduce: NCCL builds its
    communicator at the first collective."""
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    dist.all_reduce(torch.ones(1, device=device))


def ops_report() -> list[dict]:
    """Every DeepSpeed op this accelerator has: whether it could JIT-build here (DeepSpeed's own probe, run at
    its import anyway) and whether it is built (in the torch extensions cache). Nothing is built."""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible

    from zerotune.host.ops import is_cached

    return [{"op": name, "compatible": bool(probe_is_compatible(builder, False)), "built": is_cached(name)}
            for name, builder in sorted(ALL_OPS.items())]


def cpu_adam_build(dry_run: bool, build: bool) -> dict:
    """DeepSpeed's CPU-Adam op, built (or found in the torch extensions cache) and loaded, timed. A dry run only
    loads a cached one: a cold build takes minutes on 2 cores. `build=False` only says whether it is cached."""
    from deepspeed.accelerator import get_accelerator

    from zerotune.host.ops import is_cached
    from zerotune.host.ops_env import extensions_root

    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    cache, was_cached = extensions_root(), is_cached(builder.name)
    why_not = ("not built here (--no-build: the first row with offload=cpu builds it)" if not build else
               "dry run: not built here (not in the torch extensions cache)" if dry_run and not was_cached else None)
    if why_not:
        return {"op": builder.name, "seconds": None, "was_cached": was_cached, "extensions_dir": str(cache),
                "error": None, "skipped": why_not}
    started = time.perf_counter()
    try:
        builder.load(verbose=False)
        error = None
    except Exception as exc:  # no compiler, no headers: the reason is the finding
        error = f"{type(exc).__name__}: {exc}"[:2000]
    return {"op": builder.name, "seconds": round(time.perf_counter() - started, 1), "was_cached": was_cached,
            "extensions_dir": str(cache), "error": error}


def main(argv: list[str]) -> int:
    dry_run, build = "--dry-run" in argv, "--no-build" not in argv
    import torch

    gpu = not dry_run and torch.cuda.is_available()
    result = {"gpu_present": gpu, "versions": versions(gpu), "first_uses": first_uses(gpu), "ops": ops_report(),
              "cpu_adam": cpu_adam_build(dry_run, build)}
    Path(argv[0]).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

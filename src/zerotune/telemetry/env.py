"""What the run ran on: recorded with every result so numbers from different machines are not compared blindly."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from typing import Any, TypedDict

from zerotune.units import MIB


def _version(dist: str) -> str | None:
    # Package metadata, not `import deepspeed`: importing it is slow and probes for CUDA/ops at import time.
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvml_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no library / no driver
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (cgroups, taskset)
    except AttributeError:
        return os.cpu_count()


class NodeIdentity(TypedDict):
    node_rank: int  # the node's index in the job (torch elastic's GROUP_RANK)
    node: str       # SLURM's node name, else the host's: a SLURM cluster may run several nodes on one host


def node_identity() -> NodeIdentity:
    """Where this worker runs, as each rank's record in summary.json names it."""
    return NodeIdentity(node_rank=int(os.environ.get("GROUP_RANK") or 0),
                        node=os.environ.get("SLURMD_NODENAME") or socket.gethostname())


def environment_info() -> dict[str, Any]:
    """Device, GPU memory, driver, library versions, host. Missing things are None."""
    device_name, gpu_total_mib, cuda_version, gpu_count = _cpu_model(), None, None, 0
    versions = {dist: _version(dist) for dist in ("torch", "deepspeed", "accelerate", "diffusers")}
    try:
        import torch

        # the build as torch names itself (2.13.0+cu130, 2.13.0+cpu): the metadata of PyPI's CUDA build says 2.13.0
        versions["torch"] = torch.__version__
        cuda_version = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            device_name, gpu_total_mib = props.name, props.total_memory / MIB
            gpu_count = torch.cuda.device_count()
    except ImportError:
        pass
    return {
        "device_name": device_name,
        "gpu_count": gpu_count,
        "gpu_total_mib": gpu_total_mib,
        "driver_version": _nvml_driver_version(),
        "cuda_version": cuda_version,
        **versions,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": _usable_cpus(),
    }

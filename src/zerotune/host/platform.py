"""What the machine is and can do: its accelerator, DeepSpeed's support for it, its precisions; whether a folder can
take a run's files (tried, as root passes permission checks where creating fails); and what a run ran on."""

from __future__ import annotations

import ctypes.util
import os
import platform
import platform as _platform
import socket
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

import psutil
import torch

from zerotune.config.schema import MIB


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
    it cannot fork a child that uses the card). Where NVML cannot answer but the driver's library is installed, a
    device is assumed: a worker that cannot use its card costs more than one that starts slowly."""
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


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a file included)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_probe(folder: Path) -> OSError | None:
    """Create `folder` if it is missing (its parent must exist), write a file in it, then undo both; the
    error met on the way, or None."""
    created = not folder.exists()
    try:
        if created:
            folder.mkdir()
        probe = folder / f".zerotune-write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
        return None
    except OSError as exc:
        return exc
    finally:
        if created and folder.is_dir():
            folder.rmdir()


def mount_of(path: Path) -> psutil._common.sdiskpart | None:
    """The mount holding `path` (the longest mount point above it); None where none is found."""
    real = os.path.realpath(path)
    try:
        mounts = [m for m in psutil.disk_partitions(all=True)
                  if os.path.commonpath([real, m.mountpoint]) == m.mountpoint]
    except (OSError, ValueError):
        return None
    return max(mounts, key=lambda m: len(m.mountpoint)) if mounts else None


def fs_type(path: Path) -> str:
    """The type of the file system holding `path` (ext4, nfs4, tmpfs, ...); "" where unknown."""
    mount = mount_of(path)
    return mount.fstype if mount else ""


def file_system(path: Path) -> str:
    """The file system holding `path`, in words: "a proc file system", "a tmpfs file system, mounted read-only"."""
    mount = mount_of(path)
    if mount is None:
        return "an unknown file system"
    read_only = ", mounted read-only" if "ro" in mount.opts.split(",") else ""
    return f"a {mount.fstype} file system{read_only}"


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

"""GPU memory as nvidia-smi shows it, through NVML (nvidia-ml-py): per process, and for the whole device."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

# /proc/<pid>/ns/pid of the initial PID namespace (PROC_PID_INIT_INO in the kernel).
_INIT_PID_NS = "pid:[4026531836]"


def in_child_pid_namespace() -> bool:
    """True in a container with its own PID namespace: NVML then reports host PIDs that match none of ours."""
    try:
        return os.readlink("/proc/self/ns/pid") != _INIT_PID_NS
    except OSError:
        return False


class Nvml:
    """The NVML handle of the CUDA device this process uses; `ok` is False without NVML or a visible GPU."""

    def __init__(self, cuda_index: int) -> None:
        self.ok = False
        self.handle: Any = None
        self.pynvml: Any = None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
            return  # CUDA was told to see no device
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                return
            # NVML numbers devices physically and ignores CUDA_VISIBLE_DEVICES, so map the CUDA ordinal through it.
            entry = visible.split(",")[cuda_index].strip() if visible else str(cuda_index)
            self.handle = (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                           else pynvml.nvmlDeviceGetHandleByUUID(entry))  # GPU-... or MIG-...
            self.pynvml = pynvml
            self.ok = True
        except Exception as e:  # no library, no driver, no such device: all mean "not measured"
            log.debug("NVML unavailable: %s", e)

    def device_used_bytes(self) -> int:
        p = self.pynvml
        try:  # v2 separates driver-reserved memory; its `used` is what current nvidia-smi prints
            return int(p.nvmlDeviceGetMemoryInfo(self.handle, version=p.nvmlMemory_v2).used)
        except Exception:
            return int(p.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used_bytes(self) -> dict[int, int | None]:
        # usedGpuMemory is None where the driver cannot attribute memory (NVML_VALUE_NOT_AVAILABLE).
        procs = self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {int(p.pid): p.usedGpuMemory for p in procs}

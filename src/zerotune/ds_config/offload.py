"""Offload blocks, NVMe folder checks and automatic swap-buffer sizing."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from zerotune.errors import ConfigError

# DeepSpeed's own default parameter swap buffer (100M elements).
DEFAULT_PARAM_BUFFER = 100_000_000


def param_buffer_size(largest_param_numel: int) -> int:
    """A parameter swap buffer must hold the largest single parameter; round up to 1M elements."""
    need = max(DEFAULT_PARAM_BUFFER, int(largest_param_numel))
    return -(-need // 1_000_000) * 1_000_000


def offload_params_enabled(offload: Any, stage: int) -> bool:
    """`params: auto` means: offload parameters wherever DeepSpeed can (stage 3)."""
    if offload.device == "none":
        return False
    if offload.params == "auto":
        return stage == 3
    return bool(offload.params)


def offload_blocks(offload: Any, stage: int, largest_param_numel: int) -> dict:
    """The `offload_optimizer` / `offload_param` entries of `zero_optimization`."""
    if offload.device == "none":
        return {}
    pin = bool(offload.get("pin_memory", True))
    blocks: dict = {"offload_optimizer": {"device": offload.device, "pin_memory": pin}}
    if offload_params_enabled(offload, stage):
        blocks["offload_param"] = {"device": offload.device, "pin_memory": pin}
    if offload.device == "nvme":
        missing = OmegaConf.is_config(offload) and OmegaConf.is_missing(offload, "path")
        path = None if missing or offload.path is None else str(offload.path)
        blocks["offload_optimizer"].update({"nvme_path": path, "buffer_count": 4, "fast_init": False})
        if "offload_param" in blocks:
            # .get: an offload that came from a user's file has no nvme.yaml values behind it.
            size = offload.get("buffer_size", "auto")
            blocks["offload_param"].update({
                "nvme_path": path,
                "buffer_count": int(offload.get("buffer_count", 5)),
                "buffer_size": param_buffer_size(largest_param_numel) if size == "auto" else int(size),
                "max_in_cpu": int(offload.get("max_in_cpu", 1_000_000_000)),
            })
    return blocks


def check_nvme_path(path: str | None, key: str) -> Path:
    """The NVMe folder must be given, exist (or be creatable inside an existing parent) and be writable."""
    if not path:
        raise ConfigError(key, "NVMe offload needs a folder to swap to", "offload.path=/path/to/nvme/folder")
    folder = Path(path).expanduser()
    if not folder.exists():
        if not folder.parent.is_dir():
            raise ConfigError(key, f"{folder} does not exist, nor does its parent {folder.parent}",
                              "create the folder, or point offload.path at an existing one")
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(key, f"{folder} is not a folder", "point offload.path at a folder")
    probe = folder / f".zerotune-write-test-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(key, f"{folder} is not writable ({exc.strerror})",
                          "choose a folder you can write to, or fix its permissions") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{folder} is not writable", "choose a folder you can write to")
    return Path(path).expanduser()


AIO_BLOCK = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
             "overlap_events": True}

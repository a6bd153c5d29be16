"""Offload blocks, NVMe folder checks and automatic swap-buffer sizing."""

from __future__ import annotations

from pathlib import Path

from zerotune.errors import ConfigError
from zerotune.folders import file_system, write_probe
from zerotune.schema import Offload

# DeepSpeed's own default parameter swap buffer (100M elements).
DEFAULT_PARAM_BUFFER = 100_000_000


def param_buffer_size(largest_param_numel: int) -> int:
    """A parameter swap buffer must hold the largest single parameter; round up to 1M elements."""
    need = max(DEFAULT_PARAM_BUFFER, int(largest_param_numel))
    return -(-need // 1_000_000) * 1_000_000


def offload_blocks(offload: Offload, stage: int, largest_param_numel: int) -> dict:
    """The `offload_optimizer` / `offload_param` entries of `zero_optimization`."""
    if offload.device == "none":
        return {}
    pin = bool(offload.pin_memory)
    blocks: dict = {"offload_optimizer": {"device": offload.device, "pin_memory": pin}}
    # `params: auto` means: offload parameters wherever DeepSpeed can (stage 3)
    if stage == 3 if offload.params == "auto" else bool(offload.params):
        blocks["offload_param"] = {"device": offload.device, "pin_memory": pin}
    if offload.device == "nvme":
        path = None if offload.path is None else str(offload.path)
        blocks["offload_optimizer"].update({"nvme_path": path, "buffer_count": 4, "fast_init": False})
        if "offload_param" in blocks:
            size = offload.buffer_size
            blocks["offload_param"].update({
                "nvme_path": path,
                "buffer_count": int(offload.buffer_count),
                "buffer_size": param_buffer_size(largest_param_numel) if size == "auto" else int(size),
                "max_in_cpu": int(offload.max_in_cpu),
            })
    return blocks


def check_nvme_path(path: str | None, key: str) -> Path:
    """The NVMe folder must be given, be a folder (or be creatable inside an existing one), and take files."""
    if not path:
        raise ConfigError(key, "NVMe offload needs a folder to swap to", "offload.path=/path/to/nvme/folder")
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(key, f"{folder} is not a folder", "point offload.path at a folder")
    if not folder.exists() and not folder.parent.is_dir():
        raise ConfigError(key, f"{folder} does not exist, nor does its parent {folder.parent}",
                          "create the folder, or point offload.path at an existing one")
    # Do what DeepSpeed will (create the folder if missing, then a file in it) and undo it.
    created = not folder.exists()
    exc = write_probe(folder)
    if exc is None:
        return folder
    what = f"{folder} cannot be created in {folder.parent}" if created and not folder.is_dir() \
        else f"no file can be created in {folder}"
    where = folder if folder.is_dir() else folder.parent
    raise ConfigError(key, f"{what}: {exc.strerror} ({where} is on {file_system(where)})",
                      "point offload.path at a folder you can write to on a local disk (ideally NVMe)")


AIO_BLOCK = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
             "overlap_events": True}

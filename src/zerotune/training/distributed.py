"""torch.distributed environment for a process that was not started by a launcher."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """DeepSpeed initialises torch.distributed even for one process; give it a world of one on loopback."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return  # started by torchrun / accelerate launch / deepspeed: keep theirs
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))

"""torch.distributed environment: a world of one for a lone process, and the pieces ranks share.

- `ensure_single_process_env`: DeepSpeed wants torch.distributed even for one process.
- `init_accelerate_state`: on a CPU, accelerate (1.x) sees DeepSpeed's ranks as ONE process (no
  CUDA, `cpu=False`: backend None, so num_processes=1, process_index=0 on every rank) and then
  neither shards the DataLoader nor tells ranks apart. Building its state with the gloo backend first
  gives it the real world size and rank.
- `init_process_group`, `broadcast_object`: the default process group, joined early by
  externally launched ranks to agree on one run directory (DeepSpeed and accelerate reuse it).
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from collections.abc import Sequence
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_externally() -> bool:
    """Whether a launcher started this process as one rank of a world: torchrun, `accelerate launch`,
    `deepspeed`, or zerotune's own elastic launch (its workers). The one place that decides it."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def ensure_single_process_env() -> None:
    """DeepSpeed initialises torch.distributed even for one process; give it a world of one on loopback."""
    if launched_externally():
        return  # keep the launcher's world
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_process_group(timeout_s: float = 1800) -> None:
    """Join the default process group from the launcher's env (MASTER_ADDR/PORT, RANK, WORLD_SIZE)."""
    import torch
    import torch.distributed as dist

    if world_size() > 1 and not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s))


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (itself where there is no process group)."""
    import torch.distributed as dist

    if not is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def init_accelerate_state(use_deepspeed: bool, timeout_s: float) -> None:
    """Make accelerate see this process's real rank and world size under DeepSpeed on a CPU (see above).
    timeout_s: how long a collective waits for a peer (launch.collective_timeout_s)."""
    import torch

    if world_size() == 1 or not use_deepspeed or torch.cuda.is_available():
        return  # on CUDA accelerate gets it right (nccl); one process needs nothing
    from accelerate.state import PartialState

    from zerotune.ops.cpu_info import remember_cpu_info
    from zerotune.ops.torch_lib import link_torch_lib

    link_torch_lib()  # DeepSpeed's process group loads its shm op (torch under a path with a space)
    remember_cpu_info()  # whose builder asks py-cpuinfo: a new interpreter per question
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what Accelerator(deepspeed_plugin=...) sets, a bit earlier
    state = PartialState(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
    if state.num_processes != world_size():
        raise RuntimeError(f"accelerate sees {state.num_processes} processes, the launcher started {world_size()}")


def global_batch_draws(generator, local_shape: tuple[int, ...], rank_index: int, world: int,
                       num_timesteps: int, cond_dropout: float, noise_offset: float = 0.0,
                       timestep_range: Sequence[int] | None = None) -> dict:
    """This rank's slice of the random draws for the GLOBAL micro batch (world × local), from a generator
    seeded the same on every rank.

    Sample j of the global batch gets the same dropout draw, noise and timestep whatever the process
    count, so 2 processes × batch B compute what 1 process × batch 2B computes. The order of the draws
    (dropout, noise, timesteps) is the order a lone process always used: one process is bit-identical
    to before. The cost, world× the draws of one rank, is negligible next to the U-Net.

    `noise_offset` adds offset × N(0, 1) per image and channel to the noise, drawn after the timesteps (as
    diffusers' examples add it), so a run without it draws exactly what it drew before. `timestep_range`
    draws timesteps from [first, last] (inclusive) instead of all of them.
    """
    import torch

    n = local_shape[0]
    rows = slice(rank_index * n, (rank_index + 1) * n)
    total = (n * world, *local_shape[1:])
    uniform = torch.rand(total[0], generator=generator)[rows] if cond_dropout > 0 else None
    noise = torch.randn(total, generator=generator)[rows]
    first, last = timestep_range if timestep_range is not None else (0, num_timesteps - 1)
    timesteps = torch.randint(first, last + 1, (total[0],), generator=generator)[rows]
    if noise_offset:
        per_channel = (total[0], total[1], *([1] * (len(total) - 2)))
        noise = noise + noise_offset * torch.randn(per_channel, generator=generator)[rows]
    return {"uniform": uniform, "noise": noise, "timesteps": timesteps}


def gather_object(obj: Any) -> list | None:
    """[every rank's obj] on rank 0, None on the others; [obj] where there is no process group."""
    import torch.distributed as dist

    if not is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out

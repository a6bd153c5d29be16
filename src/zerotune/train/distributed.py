"""A worker's torch.distributed environment (a world of one for a lone process, the default group, what ranks
share), its intra-op threads (its share of the cores it may run on: two spinning OpenMP teams on the same cores
stall each other; a set OMP_NUM_THREADS is kept), and stop signals, which end a run between steps (status
INTERRUPTED, a last checkpoint under checkpoint.on_signal)."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Launch
from zerotune.host.process import STOP_SIGNALS, received


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
    """Under DeepSpeed on a CPU, accelerate (1.x) sees every rank as ONE process and neither shards the DataLoader
    nor tells ranks apart: build its state with gloo first. timeout_s: launch.collective_timeout_s."""
    import torch

    if world_size() == 1 or not use_deepspeed or torch.cuda.is_available():
        return  # on CUDA accelerate gets it right (nccl); one process needs nothing
    from accelerate.state import PartialState

    from zerotune.host.ops_env import link_torch_lib, remember_cpu_info

    link_torch_lib()  # DeepSpeed's process group loads its shm op (torch under a path with a space)
    remember_cpu_info()  # whose builder asks py-cpuinfo: a new interpreter per question
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what Accelerator(deepspeed_plugin=...) sets, a bit earlier
    state = PartialState(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
    if state.num_processes != world_size():
        raise RuntimeError(f"accelerate sees {state.num_processes} processes, the launcher started {world_size()}")


def global_batch_draws(generator, local_shape: tuple[int, ...], rank_index: int, world: int,
                       num_timesteps: int, cond_dropout: float, noise_offset: float = 0.0,
                       timestep_range: Sequence[int] | None = None,
                       draw_timesteps: Callable[[int, Any], Any] | None = None) -> dict:
    """This rank's slice of the random draws for the GLOBAL micro batch (world × local), from a generator seeded the
    same on every rank: sample j gets the same dropout, noise and timestep whatever the process count, drawn in the
    order a lone process always used (dropout, noise, timesteps). `noise_offset` adds offset × N(0, 1) per image and
    channel, drawn after the timesteps (as diffusers' examples do); `timestep_range`: [first, last], inclusive.
    `draw_timesteps(n, generator)`: the objective's own draw (models/diffusion.py Objective), in place of DDPM's."""
    import torch

    n = local_shape[0]
    rows = slice(rank_index * n, (rank_index + 1) * n)
    total = (n * world, *local_shape[1:])
    uniform = torch.rand(total[0], generator=generator)[rows] if cond_dropout > 0 else None
    noise = torch.randn(total, generator=generator)[rows]
    if draw_timesteps is not None:
        timesteps = draw_timesteps(total[0], generator)[rows]
    else:
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


log = logging.getLogger("zerotune")


def check_threads(setting: Any) -> None:
    """launch.threads is `auto` or a whole number of at least 1 (checked in the parent, in seconds)."""
    if str(setting) == "auto":
        return
    if isinstance(setting, bool) or not str(setting).isdigit() or int(setting) < 1:
        raise ConfigError("launch.threads", f"{setting!r} is not a thread count",
                          "launch.threads=auto (cores / workers per node) or a whole number >= 1")


def available_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one, else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def choose_threads(setting: Any, cores: int, local_workers: int, omp_env: str | None) -> tuple[int, str]:
    """(threads, the rule that gave them) for launch.threads = `setting`."""
    check_threads(setting)
    if str(setting) != "auto":
        return int(setting), "launch.threads"
    if omp_env and omp_env.strip().isdigit() and int(omp_env) >= 1:
        return int(omp_env), "OMP_NUM_THREADS"
    return max(1, cores // max(1, local_workers)), f"{cores} cores / {local_workers} workers on this node"


def apply_threads(launch: Launch) -> dict:
    """Set this worker's torch threads; the record for summary.json."""
    import torch

    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    threads, rule = choose_threads(launch.threads, available_cores(), local_workers,
                                   os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(threads)
    log.info("torch intra-op threads: %d (%s)", threads, rule)
    return {"intra_op": threads, "rule": rule}


log = logging.getLogger(__name__)

__all__ = ["STOP_SIGNALS", "StopSignals"]


class StopSignals:
    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        # One that came while the worker imported, held since its first line (job/bootstrap.py), stops it too.
        self.received = received()
        if self.received is not None:
            log.warning("%s received before training began: stopping at the first step", self.received)
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for name in STOP_SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002 (signal's signature)
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signal.Signals(signum).name
        log.warning("%s received: stopping after the current step", self.received)

    def agreed(self, device) -> str | None:
        """The stop, as every rank sees it: ranks stop after the same step, since a save is a collective."""
        stop = self.received is not None
        if world_size() > 1:
            import torch
            import torch.distributed as dist

            if dist.is_initialized():
                flag = torch.tensor([int(stop)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = bool(flag.item())
        if stop and self.received is None:
            self.received = "a stop signal on another rank"
        return self.received if stop else None

"""How many intra-op threads a worker gives torch.

torch starts one intra-op thread per core, and its OpenMP threads spin while they wait. Two workers on one
node, each with a thread per core, are two spinning teams on the same cores: each step waits on threads that
the other team has descheduled. So a worker takes its share of the cores this process may run on (its CPU
affinity, which is what a container or `taskset` grants) divided among the workers of its node.
torchrun sets OMP_NUM_THREADS for several workers per node, and a user may set it: then it is kept.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from zerotune.errors import ConfigError
from zerotune.schema import Launch

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

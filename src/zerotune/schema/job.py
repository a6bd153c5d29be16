"""The types of the keys that steer a job rather than the model it trains: checkpoints, resume, the
planner, launching, fault injection, sweep reports and tune trials (the schema's other half: schema/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# Optional[...] rather than `X | None`: OmegaConf reads these annotations at runtime.
# ruff: noqa: UP045


@dataclass(frozen=True)
class Checkpoint:
    every_n_steps: int = 0
    final: bool = True                   # a run that completes its steps saves its last one
    keep_last: int = 3
    dir: Optional[str] = None
    on_signal: bool = False              # SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2: save before stopping


@dataclass(frozen=True)
class Plan:
    only: bool = False                   # predict the job's memory and time floor, train nothing
    gpu: Optional[str] = None            # the card to plan for (plan/gpus.py); null: the one present, if any
    gpu_mib: Optional[int] = None        # or just its memory
    host_mib: Optional[int] = None       # host memory this node's job may use; null: what the host has available
    # A predicted peak above a GPU's free memory or the host's available memory (on a CPU accelerator the device's
    # memory is host memory): refuse | warn | skip
    guard: str = "refuse"


@dataclass(frozen=True)
class Resume:
    path: Optional[str] = None           # `resume=<path>` on the command line is short for resume.path
    strict: bool = False                 # a damaged newest checkpoint: stop (true) or use the previous one


@dataclass(frozen=True)
class Launch:
    num_processes: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Any = "auto"            # auto | port
    rdzv_timeout_s: float = 900
    collective_timeout_s: float = 1800   # a collective waiting this long on a lost or hung peer fails the job
    slurm: Any = "auto"                  # auto | true | false
    run_id: Optional[str] = None         # set inside SLURM jobs
    stop_grace_s: int = 120              # after a stop signal, how long workers get to finish their step and save
    threads: Any = "auto"                # auto | N: torch intra-op threads per worker (training/threads.py)


@dataclass(frozen=True)
class Debug:
    fail_at_step: Optional[int] = None
    fail_rank: Optional[int] = None
    oom_at_step: Optional[int] = None
    hang_at_step: Optional[int] = None
    kill_at_step: Optional[int] = None
    host_alloc_mib: Optional[int] = None
    validation_oom_at_step: Optional[int] = None


@dataclass(frozen=True)
class Trial:
    """What hydra/sweeper=tune sets on each of its jobs (zerotune/tune); null outside a tune sweep. The job
    reports its samples/s at each rung to the study's Optuna journal, which may stop it there (status pruned)."""
    storage: Optional[str] = None        # the study's journal file
    study: Optional[str] = None          # the study's name in it
    number: Optional[int] = None         # this job's Optuna trial number
    warmup_steps: int = 3                # steps left out of samples/s (compilation, allocator growth, caches)
    min_steps: int = 4                   # rung 0: timed steps after the warm-up
    reduction_factor: int = 3            # each rung is this many times longer; 1/this of the trials go on
    pruner: str = "successive_halving"   # successive_halving | hyperband (Optuna's) | none
    max_steps: int = 12                  # timed steps of a trial that is never stopped
    # the least relative spread a rung's figure is given (what moves a whole run, which the steps' own spread
    # cannot show): successive_halving stops a trial only when it is behind by more than the spreads
    min_spread: float = 0.10


@dataclass(frozen=True)
class Report:
    budget_mib: float = 24576
    metric: str = "gpu"
    where: Any = None                    # {key: value}, as repeats

"""Start a job's worker processes with torch's elastic launcher, under a time limit.

The launcher's agent watches the workers: when one dies it stops the others, so no peer is left
hanging in a collective. A watchdog thread turns a job that outlives `timeout_s` into a recorded
timeout by killing the worker tree, which the agent then reports as a failure.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from zerotune.training.distributed import free_port

log = logging.getLogger(__name__)


@dataclass
class LaunchResult:
    status: str                  # "ok" | "failed" | "timeout"
    error: str | None = None


def _kill_children() -> None:
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def launch_config(launch: Any, run_dir: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    port = free_port() if str(launch.master_port) == "auto" else int(launch.master_port)
    nnodes = int(launch.nnodes)
    return LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=int(launch.num_processes),
        run_id=str(launch.get("run_id") or uuid.uuid4().hex[:12]),
        # "static" is torchrun's default: node ranks are given, the master hosts the store.
        rdzv_backend="static", rdzv_endpoint=f"{launch.master_addr}:{port}",
        rdzv_configs={"rank": int(launch.node_rank), "timeout": int(launch.rdzv_timeout_s)},
        max_restarts=0, monitor_interval=0.5, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), tee=Std.ALL),
    )


def launch_workers(launch: Any, run_dir: Path, timeout_s: float | None) -> LaunchResult:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        log.error("job exceeded train.timeout_s=%s: stopping its workers", timeout_s)
        _kill_children()

    watchdog = threading.Timer(timeout_s, on_timeout) if timeout_s else None
    if watchdog:
        watchdog.daemon = True
        watchdog.start()
    try:
        elastic_launch(launch_config(launch, run_dir), sys.executable)("-u", "-m", "zerotune.launch.worker",
                                                                        str(run_dir))
        return LaunchResult("ok")
    except ChildFailedError as exc:
        if timed_out.is_set():
            return LaunchResult("timeout", f"killed after train.timeout_s={timeout_s} s")
        rank, first = exc.get_first_failure()
        detail = first.message if isinstance(first.message, str) and first.message else ""
        return LaunchResult("failed", f"rank {rank} exited with code {first.exitcode}"
                            + (f": {detail}" if detail else ""))
    finally:
        if watchdog:
            watchdog.cancel()

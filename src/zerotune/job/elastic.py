"""Start a job's worker processes with torch's elastic launcher (its agent stops every worker when one dies), under a
time limit kept by a watchdog thread, with the host's memory watched so that a worker's SIGKILL carries what the host
had left just before (records.py tells the kernel's OOM killer from a person's kill)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Launch
from zerotune.host import process
from zerotune.host.process import STOP_SIGNALS, pause
from zerotune.host.ram import HostExit, HostWatch
from zerotune.job import warm
from zerotune.job.gate import Gate
from zerotune.rundir.summary import Status
from zerotune.train.distributed import check_threads, free_port

log = logging.getLogger(__name__)


@dataclass
class LaunchResult:
    status: Status               # OK | FAILED | TIMEOUT | INTERRUPTED
    error: str | None = None
    failed_rank: int | None = None        # the global rank that failed first (the root cause)
    failed_local_rank: int | None = None  # its index on this node: logs/<run>/attempt_0/<local_rank>/
    signal: str | None = None             # interrupted: the stop signal this process received
    exitcode: int | None = None           # failed: the first failed worker's (-9: killed by SIGKILL)
    host: HostExit | None = None          # failed by a signal: the host's memory before that worker died
    failed_at: float | None = None        # failed: when this node's launcher saw it (time.time())


def check_launch(launch: Launch) -> None:
    """The launch block's own rules (seconds, before any worker starts)."""
    nnodes, node_rank = int(launch.nnodes), int(launch.node_rank)
    check_threads(launch.threads)
    if int(launch.num_processes) < 1 or nnodes < 1:
        raise ConfigError("launch.num_processes", "a job needs at least one process on one node",
                          "launch.num_processes=1 launch.nnodes=1")
    if float(launch.collective_timeout_s) <= 0:
        raise ConfigError("launch.collective_timeout_s", f"{launch.collective_timeout_s} s: a collective needs time to "
                          "complete", "launch.collective_timeout_s=1800 (torch's default; at least a step's time)")
    if not 0 <= node_rank < nnodes:
        raise ConfigError("launch.node_rank", f"node_rank {node_rank} is outside 0..{nnodes - 1}",
                          f"launch.node_rank=0 .. {nnodes - 1}, one per node")
    if str(launch.master_port) == "auto" and nnodes > 1:
        raise ConfigError("launch.master_port", "several nodes need one port they all know; auto picks a "
                          "free port on one machine only", "launch.master_port=29500 (the same on every node)")


def launch_config(launch: Launch, run_dir: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    check_launch(launch)
    nnodes = int(launch.nnodes)
    port = free_port() if str(launch.master_port) == "auto" else int(launch.master_port)
    # The static rendezvous keys its store by run id: every node of a job must use the same one.
    run_id = launch.run_id or (f"zerotune-{launch.master_addr}-{port}" if nnodes > 1
                                      else uuid.uuid4().hex[:12])
    # One log folder per node: over a shared file system, node 1's local rank 0 must not write node 0's.
    log_dir = run_dir / "logs" / (f"node{int(launch.node_rank)}" if nnodes > 1 else "")
    settings: dict[str, Any] = dict(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=int(launch.num_processes),
        run_id=str(run_id),
        # "static" is torchrun's default: node ranks are given, the master hosts the store.
        rdzv_backend="static", rdzv_endpoint=f"{launch.master_addr}:{port}",
        rdzv_configs={"rank": int(launch.node_rank), "timeout": int(launch.rdzv_timeout_s)},
        # The agent polls its workers this often: a job's end (or a worker's death) is noticed within it.
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
        # Each rank's stdout (its full log: every record, and what libraries print) to its file only; its stderr
        # (zerotune's lines, errors, tracebacks: console.py) to the file and the console.
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.OUT, tee=Std.ERR),
        # The launcher passes these on to the workers (train/distributed.py), which finish their step, save when
        # checkpoint.on_signal is set, and record INTERRUPTED; after stop_grace_s it kills them.
        signals_to_handle=",".join(STOP_SIGNALS), shutdown_timeout=int(launch.stop_grace_s),
    )
    # torch < 2.13 (the CUDA images' 2.11) has neither field: its agent keeps its own 30 s grace and SIGTERM.
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(**{key: value for key, value in settings.items() if key in known})


class Launcher:
    """Torch's elastic launch of this node's workers, in two steps: build it (importing torch's launcher takes
    a second), then `run()` it to the end. The job's time limit counts from the gate's go: the checks, and a
    one-off op build, are not the job's time."""

    def __init__(self, launch: Launch, run_dir: Path, timeout_s: float | None, gate: Gate) -> None:
        from torch.distributed.launcher.api import elastic_launch

        self.timeout_s, self.gate = timeout_s, gate
        self._launch = elastic_launch(launch_config(launch, run_dir), sys.executable)
        # Forked from the sweep's warm template where one is up (job/warm.py), else a fresh interpreter.
        self._args = warm.worker_args((str(os.getpid()), str(run_dir), gate.token))
        self._finished, self._timed_out = threading.Event(), threading.Event()
        self._host = HostWatch(skip_pids=warm.template_pids())

    def run(self) -> LaunchResult:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if self.timeout_s:
            threading.Thread(target=self._watchdog, name="zerotune-timeout", daemon=True).start()
        self._host.start()
        before = _stop_handlers()
        try:
            pause("before_workers")
            # A stop signal held since this process began (host/process.py) starts no worker; one that comes before
            # torch's agent takes the signals over stops it as the agent's own would.
            with process.raising(_signal_exception):
                self._launch(*self._args)
            return LaunchResult(Status.OK)
        except SignalException as exc:
            self.gate.decide("abort")  # workers still at the gate leave at once
            name = signal.Signals(exc.sigval).name
            log.warning("%s: the workers were told to stop", name)
            return LaunchResult(Status.INTERRUPTED, f"stopped by {name}", signal=name)
        except ChildFailedError as exc:
            if self._timed_out.is_set():
                return LaunchResult(Status.TIMEOUT, f"killed after train.timeout_s={self.timeout_s} s")
            return _failure(exc, self._host)
        finally:
            # The agent passed stop signals on to the workers; now the holding handlers (host/process.py) are back
            # while the job records itself and, under submitit, requeues (job/slurm.py).
            for sig, handler in before.items():
                signal.signal(sig, handler)
            self._host.stop()
            self._finished.set()
            self.gate.workers_gone.set()  # a cold op build waiting for their imports waits no more

    def _watchdog(self) -> None:
        while not (self.gate.decided.wait(0.2) or self._finished.is_set()):
            pass
        if self.gate.decision == "go" and not self._finished.wait(self.timeout_s):
            self._timed_out.set()
            log.error("job exceeded train.timeout_s=%s: stopping its workers", self.timeout_s)
            template = warm.template_pids()  # the sweep's, kept for its next trials: its forked workers go
            for child in psutil.Process().children(recursive=True):
                if child.pid not in template:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()


def _signal_exception(name: str) -> Exception:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException(f"Process {os.getpid()} got signal: {name}", sigval=signal.Signals[name])


def _stop_handlers() -> dict:
    """This process's handlers for the stop signals, before torch's agent puts its own (which it leaves behind)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    found = {getattr(signal, name): signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}
    return {sig: handler for sig, handler in found.items() if handler is not None}


def _failure(exc, host: HostWatch) -> LaunchResult:
    rank, first = exc.get_first_failure()
    detail = first.message.get("message", "") if isinstance(first.message, dict) else first.message
    detail = "" if not isinstance(detail, str) or detail.startswith("To enable traceback") else detail
    detail = detail.strip().splitlines()[0][:2000] if detail.strip() else ""
    # Killed by a signal (a negative code): what the host had left may say it was the kernel's OOM killer.
    exit_view = host.exit(first.pid) if first.exitcode is not None and first.exitcode < 0 else None
    return LaunchResult(Status.FAILED, f"rank {rank} exited with code {first.exitcode}"
                        + (f": {detail}" if detail else ""), failed_rank=rank, failed_local_rank=first.local_rank,
                        exitcode=first.exitcode, host=exit_view, failed_at=time.time())

"""Workers forked from a warm template for a sweep of many short jobs (`zerotune tune`'s trials): one process imports
torch, DeepSpeed, diffusers and the trainer once (~7 s a worker) and forks a worker for each stub torch's launcher
starts (job/warm_stub.py). Where it cannot serve, the stub starts cold. A worker whose stub is gone is killed; the
template and its workers die with the sweep's process. The launcher uses it while WARM_ENV names its socket."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerotune.job.bootstrap import MODULE as BOOTSTRAP

log = logging.getLogger("zerotune")

# "<socket>:<pid>:<template pid>": the template's socket, for the jobs the process <pid> launches itself (a job
# submitted elsewhere, which may inherit the variable, starts its workers cold)
WARM_ENV = "ZEROTUNE_WARM_WORKERS"
STUB = "zerotune.job.warm_stub"  # run with -m
POLL_S = 0.2


def _template() -> tuple[str, int] | None:
    """(socket, template pid) of the template started for this process's jobs, if any."""
    parts = os.environ.get(WARM_ENV, "").rsplit(":", 2)
    return (parts[0], int(parts[2])) if len(parts) == 3 and parts[1] == str(os.getpid()) else None


def worker_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """The interpreter arguments of a worker: the stub where a template is up, else the usual bootstrap."""
    template = _template()
    if template is not None and Path(template[0]).exists():
        return ("-u", "-m", STUB, template[0], *args)
    return ("-u", "-m", BOOTSTRAP, *args)


def template_pids() -> frozenset[int]:
    """The template process of this process's jobs (none where there is none): not one of a job's processes,
    in its memory figures or when its workers are stopped."""
    template = _template()
    return frozenset({template[1]}) if template is not None else frozenset()


class Template:
    """The running template: its socket, and its process (None where disabled)."""

    def __init__(self, path: str | None, proc: subprocess.Popen | None) -> None:
        self.path, self.proc = path, proc

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until it serves (its socket is bound), it has given up, or `timeout_s` has passed. A trial
        started before then starts cold, with its imports in its measured start-up."""
        deadline = time.monotonic() + timeout_s
        while self.path and self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            if Path(self.path).exists():
                return True
            time.sleep(POLL_S)
        return self.path is not None and Path(self.path).exists()


@contextlib.contextmanager
def template(log_path: Path, enabled: bool = True) -> Iterator[Template]:
    """A template process for the workers launched from this process until the block ends (stopped by its pid
    then). It imports while the caller goes on. Its log (what its imports say) goes to `log_path`; zerotune's
    lines and errors reach the console too."""
    if not enabled:
        yield Template(None, None)
        return
    folder = tempfile.mkdtemp(prefix="zerotune-warm-")  # a Unix socket's path must stay under ~100 bytes
    path = str(Path(folder) / "template.sock")
    # Its own session: a terminal's Ctrl-C reaches the sweep, not the template. NVML answers "is CUDA available?"
    # without initialising CUDA's driver, else the imports alone would poison every fork on a card
    # (benchmarks/gpu/fork_probe.py, measured on an H200). The workers keep the stub's env.
    log = open(log_path, "a")  # noqa: SIM115 (the template's stdout, closed below)
    proc = subprocess.Popen([sys.executable, "-m", "zerotune.job.warm", path, str(os.getpid())],
                            start_new_session=True, env={**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},
                            stdout=log)
    before = os.environ.get(WARM_ENV)
    os.environ[WARM_ENV] = f"{path}:{os.getpid()}:{proc.pid}"
    try:
        yield Template(path, proc)
    finally:
        if before is None:
            os.environ.pop(WARM_ENV, None)
        else:
            os.environ[WARM_ENV] = before
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def serve(path: str, owner: int) -> None:
    """The template: import what a worker imports, then fork a worker per stub that connects."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ends with the sweep
    import threading

    import_worker_modules()

    # A Python thread running at the fork could hold a lock the worker then waits on forever. Native thread
    # pools started by the imports (OpenBLAS's, torch's) are not counted: they re-create themselves in a
    # forked child (their pthread_atfork handlers), as in the workers torch's DataLoader forks.
    if threading.active_count() != 1:
        log.warning("warm workers: the template runs %d Python threads after its imports; trials start cold",
                    threading.active_count())
        return
    if _cuda_poisons_fork():
        log.warning("warm workers: the imports initialised CUDA, which a forked worker cannot use; trials start cold")
        return
    # Messages keep their boundaries (SEQPACKET): a request arrives whole, with its descriptors.
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path + ".binding")
    server.listen(16)
    os.rename(path + ".binding", path)  # the socket's file appearing is what tells the launcher it is ready
    running: dict[int, socket.socket | _Closed] = {}  # worker pid -> its stub's connection
    # worker pid -> a pidfd, readable once it exits: its stub hears at once, not at the next poll (0.1 s a trial)
    exits: dict[int, int] = {}
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)  # from the sweep (template's end); the stop signals reach workers via stubs
    for name in ("SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    while not stopping and os.getppid() == owner:
        # stubs' connections (sockets) and workers' pidfds (ints)
        watched: list[Any] = [server, *(c for c in running.values() if not isinstance(c, _Closed)), *exits.values()]
        ready, _, _ = select.select(watched, [], [], POLL_S)
        for conn in ready:
            if conn is server:
                _fork_worker(server, running, exits)
                continue
            if isinstance(conn, int):  # a worker's pidfd: it has exited, and _reap answers its stub below
                continue
            # a stub's end closed while its worker runs: the stub was killed, and the worker goes too
            pid = next((p for p, c in running.items() if c is conn), None)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                running[pid] = _Closed()  # out of the select set until reaped
                conn.close()
        _reap(running, exits)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.close()


# What each worker's setup would import again (0.3 s a trial): DeepSpeed and its op loader (accelerate's DeepSpeed
# state), and Optuna (the first rung's report).
SETUP_MODULES = ("deepspeed", "optuna", "torch.utils.cpp_extension")


def import_worker_modules(setup_too: bool | None = None) -> None:
    """What a worker imports (as benchmarks/gpu/fork_probe.py does): torch, accelerate, diffusers, the trainer, and
    SETUP_MODULES where `setup_too`, by default where no CUDA device is present (that DeepSpeed's import leaves a
    card's driver alone, as a fork needs, is unmeasured: fork_probe.py's `deepspeed_too` case)."""
    import importlib

    import zerotune.job.worker  # noqa: F401
    from zerotune.host.platform import cuda_device_present

    if not cuda_device_present() if setup_too is None else setup_too:
        for name in SETUP_MODULES:
            importlib.import_module(name)


def _cuda_poisons_fork() -> bool:
    """Whether a child forked now would be refused a CUDA device it could use (torch marks it at the fork once the
    driver is up); asked of a throwaway child (a few ms), as the mark exists only in a child."""
    import torch

    from zerotune.host.platform import cuda_device_present

    if not cuda_device_present():
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


class _Closed:
    """A reaped-to-be worker's connection once its stub is gone: nothing to select on or to answer."""

    def fileno(self) -> int:
        return -1

    def sendall(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _fork_worker(server: socket.socket, running: dict, exits: dict[int, int]) -> None:
    """One stub's request: a worker forked for it. A stub that went away mid-request is let go."""
    fds: list[int] = []
    try:
        conn, _ = server.accept()
    except OSError:
        return
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors, not 3")
    except (OSError, ValueError) as exc:
        log.warning("warm workers: a stub's request was dropped (%s); it starts its worker cold", exc)
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        for pidfd in exits.values():  # its siblings' exits are the template's to watch
            os.close(pidfd)
        _become_worker(server, conn, running, request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        conn.sendall(f"{pid}".encode())
    running[pid] = conn
    with contextlib.suppress(AttributeError, OSError):  # no pidfds (Linux < 5.3, or not Linux): found by polling
        exits[pid] = os.pidfd_open(pid)


def _reap(running: dict, exits: dict[int, int]) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in exits:
            os.close(exits.pop(pid))
        conn = running.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def _become_worker(server: socket.socket, conn: socket.socket, running: dict, request: dict,
                   fds: list[int]) -> None:
    """In the forked child: the stub's streams, environment, directory and arguments, then the worker's own
    first lines after the imports (job/bootstrap.py)."""
    code = 1
    try:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # dies with the template
        server.close()
        conn.close()
        for other in running.values():
            other.close()
        for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):  # a worker's own, as a fresh one's
            signal.signal(getattr(signal, name), signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
        logging.root.handlers.clear()  # the worker's own: its console and its rank's log (the stub's streams)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):  # written through, as `python -u` would
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(line_buffering=True)
        from zerotune.host.process import worker_logging

        worker_logging()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = request["argv"]
        from zerotune.host.process import hold

        hold()
        parent_pid, run_dir, token = request["argv"][1:4]
        from zerotune.job.gate import GateWatch

        gate = GateWatch(run_dir, token, forked=True)
        from zerotune.host.process import pause

        pause("worker_imports")
        from zerotune.job.worker import main

        code = main(run_dir, gate)
    except SystemExit as exc:
        from zerotune.host.process import exit_status

        code = exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        from zerotune.host.process import exit_now

        exit_now(code)


if __name__ == "__main__":
    from zerotune.host.process import split_console_and_log

    split_console_and_log(sys.stderr, sys.stdout)  # stdout: the sweep's warm_template.log (template())
    serve(sys.argv[1], int(sys.argv[2]))

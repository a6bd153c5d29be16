"""Workers forked from a warm template, for a sweep of many short jobs (`zerotune tune`'s trials).

A worker's start is mostly imports: torch, DeepSpeed, diffusers and the trainer take about 7 s here, paid
again by every trial. The template is one process that imports them once, then forks each worker.

torch's launcher still starts and watches every worker; what it starts is a stub (STUB: the standard library
and zerotune.launch.warm_stub only), which hands the template its standard streams, environment, working
directory and arguments over a Unix socket, waits for the forked worker's exit status and exits with it. A stop
signal the stub receives is passed on to the worker. A worker whose stub is gone (killed) is killed by the
template, as a fresh worker dies with its launcher (PR_SET_PDEATHSIG); the template and its workers die with
the sweep's process. Where the template cannot serve (not started, gone, or running a Python thread after its
imports, which makes fork unsafe), the stub runs the worker's usual first lines instead: a cold start.

`template(folder)` starts one for the sweep; the launcher uses it while WARM_ENV names its socket.
"""

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

log = logging.getLogger("zerotune")

# "<socket>:<pid>": the template's socket, for the jobs the process <pid> launches itself (a job submitted
# elsewhere, which may inherit the variable, starts its workers cold)
WARM_ENV = "ZEROTUNE_WARM_WORKERS"
STUB = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit('zerotune worker: the job process that started this worker is gone')\n"
    "from zerotune.launch.warm_stub import run\n"
    "run(sys.argv[1], sys.argv[2:])\n"
)
POLL_S = 0.2


def worker_args(bootstrap: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """The interpreter arguments of a worker: the stub where a template is up, else the usual bootstrap."""
    path, _, owner = os.environ.get(WARM_ENV, "").rpartition(":")
    if path and owner == str(os.getpid()) and Path(path).exists():
        return ("-u", "-c", STUB, path, *args)
    return ("-u", "-c", bootstrap, *args)


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
def template(enabled: bool = True) -> Iterator[Template]:
    """A template process for the workers launched from this process until the block ends (stopped by its pid
    then). It imports while the caller goes on."""
    if not enabled:
        yield Template(None, None)
        return
    folder = tempfile.mkdtemp(prefix="zerotune-warm-")  # a Unix socket's path must stay under ~100 bytes
    path = str(Path(folder) / "template.sock")
    proc = subprocess.Popen([sys.executable, "-m", "zerotune.launch.warm", path, str(os.getpid())])
    before = os.environ.get(WARM_ENV)
    os.environ[WARM_ENV] = f"{path}:{os.getpid()}"
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

    import zerotune.launch.worker  # noqa: F401  the imports every worker pays: torch, DeepSpeed, diffusers

    # A Python thread running at the fork could hold a lock the worker then waits on forever. Native thread
    # pools started by the imports (OpenBLAS's, torch's) are not counted: they re-create themselves in a
    # forked child (their pthread_atfork handlers), as in the workers torch's DataLoader forks.
    if threading.active_count() != 1:
        log.warning("warm workers: the template runs %d Python threads after its imports; trials start cold",
                    threading.active_count())
        return
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)  # the socket's file appearing is what tells the launcher the template is ready
    server.listen(16)
    running: dict[int, socket.socket] = {}  # worker pid -> its stub's connection
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    while not stopping and os.getppid() == owner:
        ready, _, _ = select.select([server, *running.values()], [], [], POLL_S)
        for conn in ready:
            if conn is server:
                _fork_worker(server, running)
            else:  # a stub's end closed while its worker runs: the stub was killed
                pid = next(p for p, c in running.items() if c is conn)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _reap(running)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.close()


def _fork_worker(server: socket.socket, running: dict[int, socket.socket]) -> None:
    conn, _ = server.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        _become_worker(server, conn, running, request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    running[pid] = conn


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def _become_worker(server: socket.socket, conn: socket.socket, running: dict[int, socket.socket], request: dict,
                   fds: list[int]) -> None:
    """In the forked child: the stub's streams, environment, directory and arguments, then the worker's own
    first lines after the imports (launch/bootstrap.py)."""
    code = 1
    try:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # dies with the template
        server.close()
        conn.close()
        for other in running.values():
            other.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):  # written through, as `python -u` would
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = request["argv"]
        from zerotune.held_signals import hold

        hold()
        parent_pid, run_dir, token = request["argv"][1:4]
        from zerotune.launch.gate import GateWatch

        gate = GateWatch(run_dir, token, forked=True)
        from zerotune.pause_hook import pause

        pause("worker_imports")
        from zerotune.launch.worker import main

        code = main(run_dir, gate)
    except SystemExit as exc:
        from zerotune.exiting import exit_status

        code = exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        from zerotune.exiting import exit_now

        exit_now(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    serve(sys.argv[1], int(sys.argv[2]))

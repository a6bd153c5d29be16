"""What torch's launcher starts for a worker forked from the warm template (job/warm.py), `python -u -m
zerotune.job.warm_stub <socket> <parent pid> <run dir> <gate token>`: it asks the template for the worker, passes
stop signals on and exits with its status, or becomes a cold worker (the bootstrap, by exec). Standard library only;
it first asks to die with its parent and checks the parent is still the job process that started it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from zerotune.host.process import STOP_SIGNALS


def main(argv: list[str]) -> None:
    """`argv`: the template's socket, then the worker's own arguments (the job process's pid first)."""
    import ctypes

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(argv[1]):
        sys.exit("zerotune worker: the job process that started this worker is gone")
    run(argv[0], argv[1:])


def run(path: str, args: list[str]) -> None:
    """`args`: the worker's own (the job process's pid, the run folder, the gate's token)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        request = {"argv": ["zerotune-worker", *args], "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        pid = int(conn.recv(64))
    except (OSError, ValueError):  # no template, or it went away: a cold worker
        from zerotune.job.bootstrap import MODULE as BOOTSTRAP

        conn.close()
        os.execv(sys.executable, [sys.executable, "-u", "-m", BOOTSTRAP, *args])

    def forward(signum, frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it has ended: its status is on its way
            pass

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    while True:
        try:
            answer = conn.recv(256)  # the worker's status, sent by the template when it ends
            break
        except InterruptedError:
            continue
    status = json.loads(answer)["status"] if answer else -signal.SIGKILL  # no answer: the template is gone
    if status < 0:  # killed by a signal: die of the same one, as the worker did (the launcher reads it so)
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler, nor need one reset
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])

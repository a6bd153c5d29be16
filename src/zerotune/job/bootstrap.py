"""The worker's first lines: `python -u -m zerotune.job.bootstrap <parent pid> <run dir> <gate token>`, started
by torch's launcher.

torch's launcher gives each worker a session of its own, so killing the job's process group misses
the workers. They ask the kernel for SIGKILL when their parent dies (PR_SET_PDEATHSIG), and do it
before importing anything: a parent killed during a worker's multi-second imports would otherwise
leave it alive, retrying its rendezvous forever. A parent that died before the request was made
is caught by comparing the parent's pid with the one it was started by.

Then it watches the job's gate (job/gate.py) before its imports, so that a job the parent refuses
ends its workers at once, wherever their imports are.

Before all that, it holds the stop signals (zerotune/host/process.py): SLURM signals the workers too, and one
still importing would die of the signal's default action; held, it stops the worker where training begins.

Standard library only until the guard: `-m` first imports the packages `zerotune` and `zerotune.job`, whose
__init__ files import nothing (3 ms more than `-c` here), and the package's heavy imports come after the guard
(zerotune.host.process, zerotune.job.gate and zerotune.host.process are standard library only).
"""

import sys

MODULE = "zerotune.job.bootstrap"  # what `python -m` runs (this file imports nothing more to say so)


def main(argv: list[str]) -> None:
    """`argv`: the job process's pid, the run folder, the gate's token."""
    from zerotune.host.process import hold

    hold()
    import ctypes
    import os
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(argv[0]):
        sys.exit("zerotune worker: the job process that started this worker is gone")
    from zerotune.host.process import worker_logging

    worker_logging()
    from zerotune.job.gate import GateWatch

    gate = GateWatch(argv[1], argv[2])
    from zerotune.host.process import pause

    pause("worker_imports")
    from zerotune.host.process import exit_now
    from zerotune.job.worker import main as train_worker

    exit_now(train_worker(argv[1], gate))


if __name__ == "__main__":
    main(sys.argv[1:])

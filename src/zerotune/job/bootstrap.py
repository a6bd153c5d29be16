"""A worker's first lines, `python -u -m zerotune.job.bootstrap <parent pid> <run dir> <gate token>` (started by
torch's launcher), standard library only until its guards: hold the stop signals, ask for SIGKILL when the parent
dies (PR_SET_PDEATHSIG: each worker has its own session, so killing the job's group misses it), check the parent
still lives, and watch the job's gate before the heavy imports, so a refused job ends its workers at once."""

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

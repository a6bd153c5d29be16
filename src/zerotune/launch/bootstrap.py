"""The worker's first lines: `python -c <BOOTSTRAP> <parent pid> <run dir> <gate token>`, started by torch's
launcher.

torch's launcher gives each worker a session of its own, so killing the job's process group misses
the workers. They ask the kernel for SIGKILL when their parent dies (PR_SET_PDEATHSIG), and do it
before importing anything: a parent killed during a worker's multi-second imports would otherwise
leave it alive, retrying its rendezvous forever. A parent that died before the request was made
is caught by comparing the parent's pid with the one it was started by.

Then it watches the job's gate (launch/gate.py) before its imports, so that a job the parent refuses
ends its workers at once, wherever their imports are.

Before all that, it holds the stop signals (zerotune/held_signals.py): SLURM signals the workers too, and one
still importing would die of the signal's default action; held, it stops the worker where training begins.
"""

# `-c` rather than `-m zerotune...`, and the standard library only until the guard: the package's heavy imports
# come after it (zerotune.held_signals, zerotune.launch.gate and zerotune.pause_hook are standard library only).
BOOTSTRAP = (
    "from zerotune.held_signals import hold; hold()\n"
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('zerotune worker: the job process that started this worker is gone')\n"
    "from zerotune.console import worker_logging; worker_logging()\n"
    "from zerotune.launch.gate import GateWatch\n"
    "gate = GateWatch(sys.argv[2], sys.argv[3])\n"
    "from zerotune.pause_hook import pause; pause('worker_imports')\n"
    "from zerotune.launch.worker import main\n"
    "from zerotune.exiting import exit_now\n"
    "exit_now(main(sys.argv[2], gate))\n"
)

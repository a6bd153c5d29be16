"""Stop signals held from a process's first line until the process can act on them.

SLURM signals every process of a job's steps at once, whatever each is doing: submitit's SIGUSR2 before a
pre-emption or the time limit, SIGTERM on `scontrol requeue`. The default action of these signals ends a process
that has no handler yet, and a job process or worker is without one for seconds while it imports: a job whose
tasks die of a signal is FAILED, never requeued, and leaves no record. So each entry point (a SLURM task's
command, train.py, a worker's first line) calls `hold()` before its heavy imports: from then on a stop signal is
only noted. The code that can act on it asks `received()`: the job process before it starts its workers
(job/elastic.py), a worker as its training begins (train/distributed.py). A Python handler does not survive exec:
every process holds its own.

Standard library only, and nothing imported here may be heavy: it runs before the imports it protects.

Ending a process without Python's interpreter teardown.

A process that imported torch, DeepSpeed and diffusers spends about 1.2 s at exit freeing its modules one
object at a time, after its work is done; a job paid it twice in a row (its worker, then its parent).
`exit_now` runs the exit handlers (which flush and close the logs), flushes stdout and stderr, then ends
the process without the teardown. A process with a non-daemon thread still running (a joblib sweep's
executor, say) exits the normal way: the interpreter's shutdown is what tells such threads to finish. Nothing the run writes is left unwritten: every file zerotune writes is closed (or renamed into
place) before the command returns.

A test hook: hold a process for a while at a named moment, so that a test can signal it right there.

ZEROTUNE_TEST_PAUSE=<moment>[,<moment>...]:<seconds> and ZEROTUNE_TEST_PAUSE_DIR=<folder>: at each named moment
the process writes `<folder>/<moment>.<pid>` and sleeps. The moments: `before_workers` (the job process, before
it starts its workers), `worker_imports` (a worker, before its heavy imports), `engine_build` (a worker, before
accelerate/DeepSpeed wrap the model), `save-<step>` (every rank, in the middle of saving that step). Unset, it
costs one dictionary lookup. Standard library only: a worker calls it before its imports.

What reaches the console: zerotune's own lines, and any library's errors.

A library's other records say nothing about the user's run (DeepSpeed picking its CPU accelerator, torch's guess
at CUDA_HOME, bitsandbytes' optional kernels, accelerate's checkpoint steps that zerotune reports itself): they go
to the run's log file only, the job process's `main.log` and each rank's `logs/.../<rank>/stdout.log`. zerotune's
own warnings (a DeepSpeed key ignored, a fallback taken, a figure unmeasured) stay on the console.

Standard library only: a worker sets this up before its first heavy import (job/bootstrap.py)."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TextIO

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
# SIGINT stays Python's own: KeyboardInterrupt already ends a starting process without killing it.
HELD = tuple(name for name in STOP_SIGNALS if name != "SIGINT")

_received: str | None = None
_raise: Callable[[str], BaseException] | None = None  # while set, a held signal raises what it returns
_aside: dict[int, Callable] = {}  # handlers another library installed for a held signal (submitit's requeue)


def hold() -> None:
    """Note the stop signals from now on; a handler someone else installed for one is set aside (`set_aside`)."""
    if threading.current_thread() is not threading.main_thread():  # Python takes handlers there only
        return
    for name in HELD:
        sig = getattr(signal, name)
        previous = signal.signal(sig, _note)
        if callable(previous) and previous is not _note:
            _aside[sig] = previous


def release() -> None:
    """Back to the handlers before `hold()`, for a process that will not act on a held signal (a sweep that only
    submits its jobs, or runs them elsewhere); one received meanwhile is delivered again, now."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in HELD:
        sig = getattr(signal, name)
        if signal.getsignal(sig) is _note:
            signal.signal(sig, _aside.pop(sig, signal.SIG_DFL))
    if _received is not None:
        signal.raise_signal(getattr(signal, _received))


def _note(signum: int, frame) -> None:  # noqa: ARG001 (signal's signature)
    global _received
    name = signal.Signals(signum).name
    _received = _received or name
    if _raise is not None:
        raise _raise(name)


def received() -> str | None:
    """The first stop signal this process received while it held them, or None."""
    return _received


def set_aside(sig: int) -> Callable | None:
    """The handler `hold()` replaced for `sig` (submitit's, for its requeue), or None."""
    return _aside.get(sig)


class raising:
    """While inside, a held stop signal raises `make(signal name)` where the main thread is, as a launcher's own
    handler would; one already received raises on entry."""

    def __init__(self, make: Callable[[str], BaseException]) -> None:
        self.make = make

    def __enter__(self) -> raising:
        global _raise
        if _received is not None:
            raise self.make(_received)
        _raise = self.make
        return self

    def __exit__(self, *exc) -> None:
        global _raise
        _raise = None


# What SystemExit carries and sys.exit takes: a status, a message (printed, status 1) or None (status 0).
ExitCode = str | int | None


def exit_status(code: ExitCode) -> int:
    """SystemExit's code as the interpreter turns it into a status: None is 0, a message is 1 (printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_now(code: ExitCode = 0) -> NoReturn:
    # Under a profiler or debugger (python -m cProfile), which writes its output after the script returns.
    traced = sys.getprofile() is not None or sys.gettrace() is not None
    if traced or any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    status = exit_status(code)
    atexit._run_exitfuncs()  # the interpreter's own call: logging.shutdown, wandb, tempfile cleanup, ...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: as the interpreter, carry on to exit
            pass
    os._exit(status)


ENV, DIR_ENV = "ZEROTUNE_TEST_PAUSE", "ZEROTUNE_TEST_PAUSE_DIR"


def pause(moment: str) -> None:
    setting = os.environ.get(ENV)
    if not setting:
        return
    moments, _, seconds = setting.rpartition(":")
    if moment not in moments.split(","):
        return
    folder = Path(os.environ.get(DIR_ENV) or ".")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{moment}.{os.getpid()}").touch()
    time.sleep(float(seconds))  # a signal's handler runs in here; the sleep then goes on (PEP 475)


OWN_LOGGERS = ("zerotune", "hydra_plugins")
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
# Loggers that print through a handler of their own and do not propagate, so the root's handlers never see them:
# DeepSpeed's (its LoggerFactory: a stdout handler, propagate off) and torch's C++-extension loader (under
# "torch", whose handler writes to stderr). A filter on the logger itself is kept when the library adds its
# handler, and catches the records logged on it from the first, import time included.
SELF_PRINTING = ("DeepSpeed", "torch.utils.cpp_extension")


class ConsoleFilter(logging.Filter):
    """A console handler's filter: zerotune's records, and any logger's at ERROR or above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".", 1)[0] in OWN_LOGGERS


class _ToRootHandlers(logging.Filter):
    """On a self-printing library logger: its record goes to the root's handlers (the log file, and the console
    where ConsoleFilter lets it through) instead of the library's own handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        logging.getLogger().handle(record)
        return False


def route_library_logs() -> None:
    """Send the self-printing libraries' records, and Python's warnings (deprecations, mostly the libraries'), to
    the root logger's handlers. Idempotent."""
    logging.captureWarnings(True)
    for name in SELF_PRINTING:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ToRootHandlers) for f in logger.filters):
            logger.addFilter(_ToRootHandlers())


def split_console_and_log(console: TextIO, log: TextIO, level: int = logging.INFO) -> None:
    """A process's root logger: every record to `log`, zerotune's and the errors to `console` too; then
    route_library_logs. A worker's `log` is its stdout, which torch's launcher writes to the rank's file only."""
    to_console = logging.StreamHandler(console)
    to_console.addFilter(ConsoleFilter())
    to_log = logging.StreamHandler(log)
    root = logging.getLogger()
    for handler in (to_console, to_log):
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(level)
    route_library_logs()


def command_logging(log_path: Path) -> None:
    """A command without a run folder (plan, doctor, ds-config, ...): its own warnings on stderr, as before;
    libraries' records to `log_path` (appended)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    split_console_and_log(sys.stderr, open(log_path, "a"), level=logging.WARNING)  # noqa: SIM115 (the process's)


def worker_logging() -> None:
    """A training worker's: stderr is the console (torch's launcher tees it), stdout the rank's log file."""
    split_console_and_log(sys.stderr, sys.stdout)

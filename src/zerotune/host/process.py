"""Process plumbing that runs before the heavy imports, so standard library only: stop signals held from a process's
first line until it can act on them (SLURM signals every process at once, and a signal's default action would end
one still importing, unrecorded), an exit without interpreter teardown, a test hook that pauses at named moments,
and what reaches the console (zerotune's lines, any library's errors) versus the run's log file."""

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
    """Note the stop signals from now on (each entry point calls it before its heavy imports; a handler does not
    survive exec); a handler someone else installed for one is set aside (`set_aside`)."""
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
    """Run the exit handlers, flush stdout and stderr, and end without the interpreter's teardown (~1.2 s after
    torch, DeepSpeed and diffusers); with a non-daemon thread still running, the normal way (sys.exit)."""
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
    """Test hook: with ZEROTUNE_TEST_PAUSE=<moment>[,<moment>...]:<seconds>, at a named moment (before_workers,
    worker_imports, engine_build, save-<step>) touch `<ZEROTUNE_TEST_PAUSE_DIR>/<moment>.<pid>` and sleep."""
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
# Loggers that print through a handler of their own and do not propagate (DeepSpeed's LoggerFactory, torch's
# C++-extension loader). A filter on the logger itself survives the library adding its handler, and catches
# records from import time on.
SELF_PRINTING = ("DeepSpeed", "torch.utils.cpp_extension")


class ConsoleFilter(logging.Filter):
    """A console handler's filter: zerotune's records, and any logger's at ERROR or above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".", 1)[0] in OWN_LOGGERS


class _ToRootHandlers(logging.Filter):
    """On a self-printing library logger: its record goes to the root's handlers instead of the library's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        logging.getLogger().handle(record)
        return False


def route_library_logs() -> None:
    """Send the self-printing libraries' records and Python's warnings to the root logger's handlers. Idempotent."""
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

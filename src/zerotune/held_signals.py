"""Stop signals held from a process's first line until the process can act on them.

SLURM signals every process of a job's steps at once, whatever each is doing: submitit's SIGUSR2 before a
pre-emption or the time limit, SIGTERM on `scontrol requeue`. The default action of these signals ends a process
that has no handler yet, and a job process or worker is without one for seconds while it imports: a job whose
tasks die of a signal is FAILED, never requeued, and leaves no record. So each entry point (a SLURM task's
command, train.py, a worker's first line) calls `hold()` before its heavy imports: from then on a stop signal is
only noted. The code that can act on it asks `received()`: the job process before it starts its workers
(launch/elastic.py), a worker as its training begins (training/stop.py). A Python handler does not survive exec:
every process holds its own.

Standard library only, and nothing imported here may be heavy: it runs before the imports it protects.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

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


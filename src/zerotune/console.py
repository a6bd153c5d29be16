"""What reaches the console: zerotune's own lines, and any library's errors.

A library's other records say nothing about the user's run (DeepSpeed picking its CPU accelerator, torch's guess
at CUDA_HOME, bitsandbytes' optional kernels, accelerate's checkpoint steps that zerotune reports itself): they go
to the run's log file only, the job process's `main.log` and each rank's `logs/.../<rank>/stdout.log`. zerotune's
own warnings (a DeepSpeed key ignored, a fallback taken, a figure unmeasured) stay on the console.

Standard library only: a worker sets this up before its first heavy import (launch/bootstrap.py).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

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

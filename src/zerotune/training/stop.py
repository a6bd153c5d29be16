"""Stop signals end a run between steps: SIGTERM (`timeout`, `kill`, a scheduler, `scontrol requeue`),
SIGINT (Ctrl-C), SIGHUP, SIGUSR1 (SLURM's `--signal` before pre-emption) and SIGUSR2 (submitit's, for the same:
SLURM sends it to every process of the job's steps, workers included, whose default action would end them
unsaved). The step in progress completes, a last checkpoint is saved when checkpoint.on_signal is set, and
the summary's status is INTERRUPTED, with the steps done."""

from __future__ import annotations

import logging
import signal
import threading

from zerotune.held_signals import STOP_SIGNALS, received
from zerotune.training import distributed

log = logging.getLogger(__name__)

__all__ = ["STOP_SIGNALS", "StopSignals"]


class StopSignals:
    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        # One that came while the worker imported, held since its first line (launch/bootstrap.py), stops it too.
        self.received = received()
        if self.received is not None:
            log.warning("%s received before training began: stopping at the first step", self.received)
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for name in STOP_SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002 (signal's signature)
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signal.Signals(signum).name
        log.warning("%s received: stopping after the current step", self.received)

    def agreed(self, device) -> str | None:
        """The stop, as every rank sees it: ranks stop after the same step, since a save is a collective."""
        stop = self.received is not None
        if distributed.world_size() > 1:
            import torch
            import torch.distributed as dist

            if dist.is_initialized():
                flag = torch.tensor([int(stop)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = bool(flag.item())
        if stop and self.received is None:
            self.received = "a stop signal on another rank"
        return self.received if stop else None

"""One run's checkpoints: when a periodic one is due, the final one of a completed run, and what summary.json
says of them. The trainer says what a checkpoint holds (store.SaveRequest); this says when and where."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerotune import checkpoints
from zerotune.checkpoints import store

log = logging.getLogger(__name__)


class RunSaves:
    def __init__(self, settings: Any, run_dir: Path, resumed: checkpoints.ResumeDecision | None) -> None:
        self.settings, self.resumed = settings, resumed
        self.root = checkpoints.checkpoint_root(settings.dir, run_dir)
        self.job = checkpoints.job_token(run_dir)
        self.saved: list[dict] = []        # this run's checkpoints
        self.final: str | None = None      # the last step's, once training completed

    def due(self, step: int) -> bool:
        every = self.settings.every_n_steps
        return every > 0 and step % every == 0

    def save(self, accelerator: Any, step: int, request: Callable[[], store.SaveRequest]) -> None:
        """Save `step` (every rank calls it) unless it is saved already; `request` builds what it holds."""
        if (self.saved and self.saved[-1]["step"] == step) or self._resumed_at(step):
            return
        info = store.save(accelerator, request())
        self.saved.append({"step": step, **info})
        log.info("checkpoint %s (%.1f MiB, %.1f s)", info["path"], info["bytes"] / 2**20, info["seconds"])

    def save_final(self, step: int, save: Callable[[], None]) -> None:
        """The completed run's last step (checkpoint.final), unless a periodic save or the checkpoint this run
        resumed from already holds it. Every rank calls it."""
        if not self.settings.final or step == 0:
            return
        if self._resumed_at(step):
            self.final = str(checkpoints.step_dir(self.root, step))  # resumed at max_steps: nothing to rewrite
            return
        save()
        self.final = self.saved[-1]["path"]

    def _resumed_at(self, step: int) -> bool:
        """Whether `step` is this run's own checkpoint it resumed from: nothing trained since, and rewriting it (a
        stop signal before the first step of a requeued attempt) would only put the job's newest save at risk."""
        here = checkpoints.step_dir(self.root, step)
        return self.resumed is not None and self.resumed.path.absolute() == here.absolute()

    def summary(self) -> dict:
        last = checkpoints.latest(self.root)
        out: dict[str, Any] = {"saved": self.saved, "last_complete": str(last) if last is not None else None, "final": self.final}
        rp = self.resumed
        if rp is not None:
            out["resumed_from"] = {"path": str(rp.path), "step": rp.meta.get("step"), "mode": rp.mode,
                                   "changed": {k: list(v) for k, v in rp.changed.items()}}
        return out

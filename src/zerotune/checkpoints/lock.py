"""One job at a time writes into a checkpoint dir: two jobs sharing one would delete each other's saves
(keep_last) while both report them. The lock is the kernel's (filelock's flock): a killed job's lock
goes with its process, so nothing stale is ever left to clean by hand."""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from filelock import FileLock, Timeout

from zerotune.checkpoints.layout import checkpoint_root
from zerotune.errors import ConfigError
from zerotune.files import write_json_atomic
from zerotune.schema import Checkpoint

LOCK_FILE = ".zerotune.lock"
OWNER_FILE = ".zerotune.lock.json"  # beside the lock: filelock truncates the lock file when it opens it


class CheckpointDirLock:
    def __init__(self, root: Path, run_dir: str | Path):
        self.root, self.run_dir = Path(root), str(run_dir)
        self._lock: FileLock | None = None
        self._made_run_folder = False

    def acquire(self) -> CheckpointDirLock:
        # Only the run dir's own checkpoints/ is removed again when unused: a checkpoint.dir named by the
        # user stays, as asked for.
        self._made_run_folder = not self.root.exists() and self.root == Path(self.run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise ConfigError("checkpoint.dir", f"{self.root} is in use by {self._owner()}",
                              "give each job its own checkpoint.dir (the default, <run dir>/checkpoints, is "
                              "one per run), or wait for that job to end") from None
        self._lock = lock
        write_json_atomic(self.root / OWNER_FILE, {"run_dir": self.run_dir, "pid": os.getpid(),
                                                   "host": socket.gethostname(), "since": time.time()})
        return self

    def _owner(self) -> str:
        try:
            owner = json.loads((self.root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            return "another job"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        return f"the job in {owner.get('run_dir')} (pid {owner.get('pid')} on {owner.get('host')}, since {since})"

    def release(self) -> None:
        if self._lock is not None:
            (self.root / OWNER_FILE).unlink(missing_ok=True)
            if self._made_run_folder:
                self._remove_unused_root()
            self._lock.release()
            self._lock = None

    def _remove_unused_root(self) -> None:
        """The run dir's checkpoints/ this lock made, when the job saved nothing into it (refused, failed or
        stopped before a save, or nothing to save): it goes with the job. Emptied while the lock is still held, so a job that
        opens the lock file meanwhile is refused, as it would have been a moment earlier."""
        try:
            if {p.name for p in self.root.iterdir()} <= {LOCK_FILE}:
                (self.root / LOCK_FILE).unlink(missing_ok=True)
                self.root.rmdir()
        except OSError:
            pass  # something arrived meanwhile: the folder stays

    def __enter__(self) -> CheckpointDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def job_lock(checkpoint: Checkpoint, run_dir: str | Path) -> AbstractContextManager:
    """The lock a job holds while it runs: on its checkpoint dir when it will save there, else none."""
    if checkpoint.every_n_steps > 0 or checkpoint.final or checkpoint.on_signal:
        return CheckpointDirLock(checkpoint_root(checkpoint.dir, Path(run_dir)), run_dir)
    return nullcontext()

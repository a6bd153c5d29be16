"""The gate between a job's checks and its workers' training: the workers start first and import while the
parent checks the job, then train only when the parent says so.

A worker's imports (torch, DeepSpeed, diffusers: seconds) need nothing from the checks, and the checks
(the user's files, the DeepSpeed dict, the plan, DeepSpeed's ops) need nothing from the workers, so they
run side by side; the job's first step no longer waits for the two in a row.

The parent decides once, in a file named by a token that only this launch's workers know (so a rerun into
the same run directory, or a second node sharing it, never reads another launch's decision):
- `go`: the checks passed, config.yaml and job.json are final; the workers load them and train;
- `abort` (a refused job) or `skip` (predicted to run out of GPU memory): each worker ends at once, with
  status 0 and nothing written, even in the middle of its imports; the parent reports the job.

A worker at the gate says so (`<gate file>.arrived.<pid>`): a cold DeepSpeed op build, which takes every core
for minutes, waits for the workers' imports to end rather than slowing them.

Standard library only: a worker starts watching before it imports anything (job/bootstrap.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

DECISIONS = ("go", "abort", "skip")
POLL_S = 0.01  # a stat() per poll: nothing next to a worker's imports, and the decision is seen at once
ARRIVAL_POLL_S = 0.05


def gate_file(run_dir: str | Path, token: str) -> Path:
    return Path(run_dir) / f".gate-{token}.json"


class Gate:
    """The parent's side: `decide` once; `decided` is set whatever the decision."""

    def __init__(self, run_dir: str | Path) -> None:
        self.token = uuid.uuid4().hex[:16]
        self.path = gate_file(run_dir, self.token)
        self.decision: str | None = None
        self.decided = threading.Event()
        self.workers_gone = threading.Event()

    def decide(self, decision: str) -> None:
        if decision not in DECISIONS:
            raise ValueError(f"a gate decision is one of {DECISIONS}, got {decision!r}")
        if self.decision is not None:
            return  # the first decision stands (an abort after a go changes nothing the workers read)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"decision": decision, "at": time.time()}))
        os.replace(tmp, self.path)  # atomic: a worker reads the whole decision or none
        self.decision = decision
        self.decided.set()

    def wait_for_arrivals(self, workers: int, timeout_s: float) -> int:
        """Until `workers` workers wait at the gate (their imports done), the workers are gone
        (`workers_gone`, set by the job when its launcher returns), or `timeout_s`; how many arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            arrived = len(list(self.path.parent.glob(f"{self.path.name}.arrived.*")))
            if arrived >= workers or self.workers_gone.is_set() or time.monotonic() >= deadline:
                return arrived
            self.workers_gone.wait(ARRIVAL_POLL_S)

    def remove(self) -> None:
        for path in [self.path, *self.path.parent.glob(f"{self.path.name}.arrived.*")]:
            path.unlink(missing_ok=True)


class GateWatch:
    """A worker's side: a thread that watches for the decision from the worker's first line on. A refusal ends
    the process where it stands (it has written nothing yet); `wait_for_go` returns when training may start."""

    def __init__(self, run_dir: str | Path, token: str, forked: bool = False) -> None:
        self.path = gate_file(run_dir, token)
        self.forked = forked  # forked from the sweep's warm template (job/warm.py), not a fresh interpreter
        self.opened_at: float | None = None
        self._go = threading.Event()
        threading.Thread(target=self._watch, name="zerotune-gate", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                decision = json.loads(self.path.read_text()).get("decision")
            except (OSError, ValueError):  # not decided yet
                decision = None
            if decision == "go":
                self.opened_at = time.time()
                self._go.set()
                return
            if decision is not None:
                os._exit(0)  # refused or skipped: the parent records why; nothing here to flush or keep
            time.sleep(POLL_S)

    def wait_for_go(self) -> dict:
        """Block until the parent says go; the worker's marks: imports done (reached the gate), gate open."""
        reached = time.time()
        self.path.with_name(f"{self.path.name}.arrived.{os.getpid()}").touch()  # for a cold op build (host/ops.py)
        self._go.wait()
        return {"gate_reached": reached, "gate_open": max(self.opened_at or reached, reached),
                "forked_from_template": self.forked}

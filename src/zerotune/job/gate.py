"""The gate between a job's checks and its workers' training: workers import while the parent checks, then train
only on `go`; on `abort` or `skip` each ends at once with status 0, having written nothing. The decision's file is
named by a token only this launch's workers know. Standard library only: a worker watches before any import."""

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
        """Wait until `workers` workers wait at the gate (`<gate file>.arrived.<pid>`), the workers are gone
        (`workers_gone`) or `timeout_s` passed; how many arrived (a cold op build waits not to slow their imports)."""
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

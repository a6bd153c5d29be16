"""A job's checks, run in a thread of the job's parent while its workers import (launch/gate.py).

From the settled config (frozen before the workers started), everything that fails in seconds: the
DeepSpeed dict, the checkpoint to resume, the weights to load, the plan (and its guard); the resolved run
is written once (resolved.json) for the workers to read. Then DeepSpeed's ops, built or loaded before the
job's memory sampler starts (a one-off JIT compile is not this configuration's cost). A refusal is recorded
in summary.json, the gate turns the workers away, and the job's parent raises it. The thread writes files;
it changes no configuration.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from zerotune.compose.settle import Settled
from zerotune.launch.gate import Gate
from zerotune.launch.records import base_summary, refusal_recorded
from zerotune.ops.build import prebuild_ops
from zerotune.plan import guard as planning
from zerotune.preflight import check
from zerotune.rundir import RunDir
from zerotune.rundir.run_summary import RunSummary
from zerotune.rundir.spec import JobSpec
from zerotune.rundir.status import Status
from zerotune.telemetry import MemorySampler
from zerotune.telemetry.startup import Marks

log = logging.getLogger("zerotune")


# A worker imports in seconds; one that takes longer does not hold a build back for good.
ARRIVAL_TIMEOUT_S = 120.0


class JobChecks:
    """`start()` the checks; `join()` returns the summary's base (config sources, plan, op builds) or raises
    what refused the job. The gate is decided whatever happens: go, skip (predicted OOM) or abort."""

    def __init__(self, settled: Settled, spec: JobSpec, run_dir: RunDir, gate: Gate, sampler: MemorySampler) -> None:
        self.settled, self.spec, self.run_dir, self.gate, self.sampler = settled, spec, run_dir, gate, sampler
        self.marks: Marks | None = None
        self.base: RunSummary | None = None
        self.error: BaseException | None = None
        # A daemon: a job stopped by a signal mid-build does not wait for the compiler.
        self._thread = threading.Thread(target=self._run, name="zerotune-checks", daemon=True)

    def start(self) -> JobChecks:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> RunSummary | None:
        """The summary's base once the checks are done (None if they are still running after `timeout`)."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.base

    def _run(self) -> None:
        self.marks = Marks()
        try:
            self.base = self._check(self.marks)
        except BaseException as exc:  # re-raised by join(), in the job's own thread
            self.error = exc
        finally:
            self.gate.decide("abort")  # no-op after go or skip: the first decision stands

    def _check(self, marks: Marks) -> RunSummary:
        config, spec, run_dir = self.settled.config, self.spec, self.run_dir
        # preflight's checks, with the job's run dir: the checkpoint to resume is chosen and checksummed once,
        # here, not per rank.
        with refusal_recorded(config, spec, run_dir):
            run = check(self.settled, run_dir=spec.run_dir)
            gpu = planning.job_gpu(config)  # a card the planner does not know
        marks.mark("checks")
        plan = planning.job_plan(run, gpu)
        run = replace(run, plan=plan)
        base = base_summary(config, spec)
        base.config_sources, base.config_warnings, base.plan = run.config_sources, list(run.config_warnings), plan
        marks.mark("plan")
        with refusal_recorded(config, spec, run_dir, plan=plan):  # the predicted peak is above the memory there is
            decision = planning.guard(config, plan)
        if decision == Status.PREDICTED_OOM:
            self.gate.decide("skip")
            return base
        run_dir.write_ds_config(run.ds_config)
        run.save(run_dir.path)  # what every worker trains from
        with refusal_recorded(config, spec, run_dir):
            base.ops_build = prebuild_ops(run.ds_config, run.use_deepspeed, self._workers_imported)
        marks.mark("ops_build")
        self.sampler.start()  # the job's memory: its workers from here on
        self.gate.decide("go")
        return base

    def _workers_imported(self) -> None:
        """A cold op build takes every core: it starts once this node's workers wait at the gate (a bounded wait)."""
        arrived = self.gate.wait_for_arrivals(int(self.settled.config.launch.num_processes), ARRIVAL_TIMEOUT_S)
        log.info("%d worker(s) done importing; building DeepSpeed's ops", arrived)

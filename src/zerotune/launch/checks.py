"""A job's checks, run in a thread of the job's parent while its workers import (launch/gate.py).

Everything that fails in seconds: the config with the user's files folded in, the DeepSpeed dict, the
checkpoint to resume, the weights to load, the plan (and its guard), then DeepSpeed's ops, built or
loaded before the job's memory sampler starts (a one-off JIT compile is not this configuration's cost).
A refusal is recorded in summary.json, the gate turns the workers away, and the job's parent raises it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from zerotune.errors import ConfigError
from zerotune.launch import planning
from zerotune.launch.elastic import check_launch
from zerotune.launch.gate import Gate
from zerotune.launch.records import base_summary, record_refusal
from zerotune.ops.build import prebuild_ops
from zerotune.preflight import CheckedRun, preflight
from zerotune.rundir import RunDir
from zerotune.rundir.spec import JobSpec
from zerotune.telemetry import MemorySampler
from zerotune.telemetry.startup import Marks

log = logging.getLogger("zerotune")


# A worker imports in seconds; one that takes longer does not hold a build back for good.
ARRIVAL_TIMEOUT_S = 120.0


class JobChecks:
    """`start()` the checks; `join()` returns the summary's base (config sources, plan, op builds) or raises
    what refused the job. The gate is decided whatever happens: go, skip (predicted OOM) or abort."""

    def __init__(self, cfg: Any, spec: JobSpec, run_dir: RunDir, gate: Gate, sampler: MemorySampler) -> None:
        self.cfg, self.spec, self.run_dir, self.gate, self.sampler = cfg, spec, run_dir, gate, sampler
        self.marks: Marks | None = None
        self.base: dict | None = None
        self.error: BaseException | None = None
        # A daemon: a job stopped by a signal mid-build does not wait for the compiler.
        self._thread = threading.Thread(target=self._run, name="zerotune-checks", daemon=True)

    def start(self) -> JobChecks:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> dict | None:
        """The summary's base once the checks are done (None if they are still running after `timeout`)."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.base

    @property
    def skipped(self) -> bool:
        return self.gate.decision == "skip"

    def _run(self) -> None:
        self.marks = Marks()
        try:
            self.base = self._check()
        except BaseException as exc:  # re-raised by join(), in the job's own thread
            self.error = exc
        finally:
            self.gate.decide("abort")  # no-op after go or skip: the first decision stands

    def _check(self) -> dict:
        cfg, spec, run_dir = self.cfg, self.spec, self.run_dir
        checked = checked_job(cfg, spec, run_dir)
        self.marks.mark("checks")
        base = {**base_summary(cfg, spec), "config_sources": checked.config_sources,
                "config_warnings": checked.config_warnings,
                "plan": planning.job_plan(cfg, checked, planning.job_gpu(cfg))}
        self.marks.mark("plan")
        try:
            decision = planning.guard(cfg, base["plan"])
        except ConfigError as exc:  # the predicted peak is above the memory there is: recorded with the plan
            record_refusal(cfg, spec, run_dir, exc, plan=base["plan"])
            raise
        if decision == "predicted_oom":
            self.gate.decide("skip")
            return base
        run_dir.write_ds_config(checked.ds_config)
        try:
            base["ops_build"] = prebuild_ops(checked.ds_config, checked.use_deepspeed, self._workers_imported)
        except ConfigError as exc:
            record_refusal(cfg, spec, run_dir, exc)
            raise
        self.marks.mark("ops_build")
        self.sampler.start()  # the job's memory: its workers from here on
        self.gate.decide("go")
        return base

    def _workers_imported(self) -> None:
        """A cold op build takes every core: it starts once this node's workers wait at the gate (a bounded wait)."""
        arrived = self.gate.wait_for_arrivals(int(self.cfg.launch.num_processes), ARRIVAL_TIMEOUT_S)
        log.info("%d worker(s) done importing; building DeepSpeed's ops", arrived)


def checked_job(cfg: Any, spec: JobSpec, run_dir: RunDir) -> CheckedRun:
    """preflight, with the job's run dir; what the workers take from it is written for them (config.yaml with
    the user's files folded in, and in launch.json the checkpoint chosen and checksummed once, not per rank)."""
    try:
        checked = preflight(cfg, overrides=spec.overrides, run_dir=spec.run_dir)
        check_launch(cfg.launch)
        planning.job_gpu(cfg)  # a card the planner does not know
    except ConfigError as exc:
        record_refusal(cfg, spec, run_dir, exc)
        raise
    spec.from_parent = True
    if checked.resume is not None:
        cfg.resume.path = spec.resume_verified = str(checked.resume.path)
    run_dir.write_config(cfg)
    spec.save()
    return checked

"""A job, as the Hydra process sees it: write the config, start the workers, check the job in a thread while they
import (job/gate.py), and record what happened. Whatever the workers do, summary.json ends with a status and the
job's peak memory, and the sweep's process carries on to the next job."""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from dataclasses import replace

from zerotune.config.compose.settle import Settled
from zerotune.config.schema import Config
from zerotune.host.memory import MemorySampler
from zerotune.host.ops import prebuild_ops
from zerotune.host.platform import environment_info, node_identity
from zerotune.host.timing import Marks, ParentMarks, startup_view
from zerotune.job import warm
from zerotune.job.elastic import Launcher, LaunchResult
from zerotune.job.gate import Gate
from zerotune.job.records import base_summary, merge_job_view, name_failed_node, refusal_recorded
from zerotune.plan import guard
from zerotune.plan.resolve import check
from zerotune.rundir import JobSpec, RunDir, resume
from zerotune.rundir.summary import RunSummary, Status, node_summary_name

log = logging.getLogger("zerotune")


def run_job(settled: Settled, spec: JobSpec) -> RunSummary:
    """The parent side of a job: it writes the settled config, starts the workers (job/worker.py), checks the job
    while they import (they train only if the checks pass, from resolved.json), watches and records."""
    marks = ParentMarks()
    marks.mark("compose_and_imports")  # this process's start to here: Python, Hydra, zerotune's imports
    run_dir = RunDir(spec.run_dir)
    if settled.config.launch.node_rank == 0:  # the job's other nodes share this folder, or keep no record of it
        run_dir.write_config(settled.config)
    spec = replace(spec, from_parent=True)
    spec.save()
    if settled.config.plan.only:
        return plan_only(settled, spec, run_dir)
    config = settled.config
    held = ExitStack()  # the checkpoint dir's lock, the gate's file, the memory sampler: until the workers are done
    with held:
        if config.launch.node_rank == 0:  # one lock per job: its other nodes write their shards into the same dir
            with refusal_recorded(config, spec, run_dir):  # another job holds it: no worker starts
                held.enter_context(resume.job_lock(config.checkpoint, run_dir.path))
        marks.mark("launch_checks")
        gate = Gate(run_dir.path)
        held.callback(gate.remove)
        nvme = config.offload.path if config.offload.device == "nvme" else None
        # The job's own view of memory: every worker on this node, whatever becomes of them (started by the checks).
        sampler = MemorySampler(nvme_dir=nvme, include_root=False, skip_pids=warm.template_pids())
        held.callback(sampler.stop)
        launcher = Launcher(config.launch, run_dir.path, config.train.timeout_s, gate)
        marks.mark("launcher_imports")
        checks = JobChecks(settled, spec, run_dir, gate, sampler).start()
        result = launcher.run()
        # Stopped by a signal mid-check (an op build, say): the workers are gone, the build is not waited for.
        base = checks.join(timeout=0 if result.status == Status.INTERRUPTED else None) or base_summary(config, spec)
        if gate.decision == "skip":  # plan.guard=skip: recorded as predicted to run out of GPU memory, and not run
            base.status, base.env = Status.PREDICTED_OOM, environment_info()
            run_dir.write_summary(base)
            return base
        sampler.stop()
        summary = _workers_summary(config, run_dir, base, result)
        # What the parent's checks found, and the job's start as a whole (slurm: the job and its attempt).
        summary.slurm = base.slurm
        summary.startup = startup_view(marks, summary.startup_marks, checks.marks)
        if base.plan is not None:
            summary.plan = base.plan
        if base.ops_build is not None:
            summary.ops_build = base.ops_build
    summary = merge_job_view(summary, result, sampler.peaks(), run_dir.path)
    node_rank, nnodes = config.launch.node_rank, config.launch.nnodes
    if node_rank != 0:  # node 0 writes the job's summary.json; any other node its own summary.node<k>.json
        summary.write(run_dir.path, node_summary_name(node_rank))
    else:
        if nnodes > 1 and result.status == Status.FAILED:  # naming the node that failed first
            name_failed_node(summary, result, node_identity()["node"], run_dir.path, nnodes)
        run_dir.write_summary(summary)
    return summary


def plan_only(settled: Settled, spec: JobSpec, run_dir: RunDir) -> RunSummary:
    """plan.only=true: the checks and the prediction, no training; summary.json says PLANNED."""
    from zerotune.plan import guard
    from zerotune.plan.resolve import check

    config = settled.config
    with refusal_recorded(config, spec, run_dir):
        gpu = guard.job_gpu(config)
        run = check(settled)
    run_dir.write_ds_config(run.ds_config)
    summary = base_summary(config, spec)
    summary.update({"status": Status.PLANNED, "config_sources": run.config_sources,
                    "config_warnings": list(run.config_warnings),
                    "plan": guard.job_plan(run, gpu), "env": environment_info()})
    run_dir.write_summary(summary)
    return summary


def _workers_summary(cfg: Config, run_dir: RunDir, base: RunSummary, result: LaunchResult) -> RunSummary:
    """The summary to complete: rank 0's own, or this node's."""
    node_rank = cfg.launch.node_rank
    if node_rank != 0:
        # Rank 0, on node 0, writes the job's summary.json (over a shared file system, this same folder);
        # this node records its own ranks' outcome beside it, in summary.node<k>.json.
        base.update({"status": Status.OK if result.status == Status.OK else Status.FAILED, "node_rank": node_rank,
                     "node": node_identity()["node"],
                     "note": "the job's summary.json is written by node 0", "env": environment_info()})
        return base
    workers = RunSummary.read(run_dir.path)
    if workers is None:
        base.env = environment_info()
    return workers or base


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
        # The checkpoint to resume is chosen and checksummed once, here, not per rank.
        with refusal_recorded(config, spec, run_dir):
            run = check(self.settled, run_dir=spec.run_dir)
            gpu = guard.job_gpu(config)  # a card the planner does not know
        marks.mark("checks")
        plan = guard.job_plan(run, gpu)
        run = replace(run, plan=plan)
        base = base_summary(config, spec)
        base.config_sources, base.config_warnings, base.plan = run.config_sources, list(run.config_warnings), plan
        marks.mark("plan")
        with refusal_recorded(config, spec, run_dir, plan=plan):  # the predicted peak is above the memory there is
            decision = guard.guard(config, plan)
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

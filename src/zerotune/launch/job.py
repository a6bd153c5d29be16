"""A job, as the Hydra process sees it: check the config, start the workers, record what happened.

Whatever the workers do (finish, raise, run out of memory, hang, get killed), the job's
summary.json ends with a status and the peak memory the job reached, and the process that
runs the sweep carries on to the next job.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace

from zerotune import checkpoints
from zerotune.compose.settle import Settled
from zerotune.launch import warm
from zerotune.launch.elastic import Launcher, LaunchResult
from zerotune.launch.gate import Gate
from zerotune.launch.node_failures import name_failed_node
from zerotune.launch.records import base_summary, merge_job_view, refusal_recorded
from zerotune.rundir import RunDir
from zerotune.rundir.run_summary import RunSummary, node_summary_name
from zerotune.rundir.spec import JobSpec
from zerotune.rundir.status import Status
from zerotune.schema import Config
from zerotune.telemetry import MemorySampler, environment_info
from zerotune.telemetry.env import node_identity
from zerotune.telemetry.startup import ParentMarks, startup_view

log = logging.getLogger("zerotune")


def run_job(settled: Settled, spec: JobSpec) -> RunSummary:
    """The parent side of a job: its workers train (launch/worker.py); this process resolves, watches, records.

    The config, settled at the command line (the user's files folded in), is written once; the workers start as
    soon as it is, and the checks that need DeepSpeed and the model run while they import: they train only if
    the checks pass (launch/gate.py), reading the run the checks resolved (resolved.json)."""
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
                held.enter_context(checkpoints.job_lock(config.checkpoint, run_dir.path))
        marks.mark("launch_checks")
        gate = Gate(run_dir.path)
        held.callback(gate.remove)
        nvme = config.offload.path if config.offload.device == "nvme" else None
        # The job's own view of memory: every worker on this node, whatever becomes of them (started by the checks).
        sampler = MemorySampler(nvme_dir=nvme, include_root=False, skip_pids=warm.template_pids())
        held.callback(sampler.stop)
        launcher = Launcher(config.launch, run_dir.path, config.train.timeout_s, gate)
        marks.mark("launcher_imports")
        # Imported here, after the launcher: the checks' modules (DeepSpeed, the planner) load beside the workers'
        # imports instead of before the workers start.
        from zerotune.launch.checks import JobChecks

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
    from zerotune.plan import guard as planning
    from zerotune.preflight import check

    config = settled.config
    with refusal_recorded(config, spec, run_dir):
        gpu = planning.job_gpu(config)
        run = check(settled)
    run_dir.write_ds_config(run.ds_config)
    summary = base_summary(config, spec)
    summary.update({"status": Status.PLANNED, "config_sources": run.config_sources,
                    "config_warnings": list(run.config_warnings),
                    "plan": planning.job_plan(run, gpu), "env": environment_info()})
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

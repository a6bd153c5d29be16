"""A job, as the Hydra process sees it: check the config, start the workers, record what happened.

Whatever the workers do (finish, raise, run out of memory, hang, get killed), the job's
summary.json ends with a status and the peak memory the job reached, and the process that
runs the sweep carries on to the next job.
"""

from __future__ import annotations

import copy
import logging
import os
from contextlib import ExitStack
from typing import Any

from zerotune import checkpoints
from zerotune.errors import ConfigError
from zerotune.launch.elastic import Launcher, check_launch
from zerotune.launch.gate import Gate
from zerotune.launch.node_failures import name_failed_node
from zerotune.launch.records import base_summary, merge_job_view, record_refusal
from zerotune.rundir import RunDir, write_json_atomic
from zerotune.rundir.spec import JobSpec
from zerotune.slurm.job import continue_requeued, in_slurm_job, launch_from_slurm
from zerotune.telemetry import MemorySampler, environment_info
from zerotune.telemetry.env import node_identity
from zerotune.telemetry.startup import ParentMarks, startup_view
from zerotune.user_config import resolve

log = logging.getLogger("zerotune")


def run_job(cfg: Any, spec: JobSpec) -> dict:
    """The parent side of a job: its workers train (launch/worker.py); this process checks, watches, records.

    The workers start as soon as it is known how many to start; the checks run while they import, and they
    train only if the checks pass (launch/gate.py)."""
    marks = ParentMarks()
    marks.mark("compose_and_imports")  # this process's start to here: Python, Hydra, zerotune's imports
    apply_slurm_geometry(cfg, spec.run_dir)
    run_dir = RunDir(spec.run_dir)
    run_dir.write_config(cfg)
    if cfg.plan.only:
        return plan_only(cfg, spec, run_dir)
    held = ExitStack()  # the checkpoint dir's lock, the gate's file, the memory sampler: until the workers are done
    with held:
        launch = settled_launch(cfg, spec, run_dir, held)
        marks.mark("launch_checks")
        gate = Gate(run_dir.path)
        held.callback(gate.remove)
        nvme = cfg.offload.path if cfg.offload.device == "nvme" else None
        # The job's own view of memory: every worker on this node, whatever becomes of them (started by the checks).
        sampler = MemorySampler(nvme_dir=nvme, include_root=False)
        held.callback(sampler.stop)
        launcher = Launcher(launch, run_dir.path, cfg.train.timeout_s, gate)
        marks.mark("launcher_imports")
        checks = _start_checks(cfg, spec, run_dir, gate, sampler)
        result = launcher.run()
        # Stopped by a signal mid-check (an op build, say): the workers are gone, the build is not waited for.
        base = checks.join(timeout=0 if result.status == "interrupted" else None) or base_summary(cfg, spec)
        if checks.skipped:
            return _skipped(run_dir, base)
        sampler.stop()
        summary = _workers_summary(cfg, run_dir, base, result)
        summary.update({k: base[k] for k in ("ops_build", "plan", "slurm") if k in base})  # slurm: job, attempt
        summary["startup"] = startup_view(marks, summary.get("startup_marks"), checks.marks)
    summary = merge_job_view(summary, result, sampler.peaks(), run_dir.path)
    _write(cfg, run_dir, summary, result)
    return summary


def _write(cfg: Any, run_dir: RunDir, summary: dict, result) -> None:
    """Node 0 writes the job's summary.json (naming the node that failed first, in a job of several nodes);
    any other node its own summary.node<k>.json beside it."""
    node_rank, nnodes = int(cfg.launch.node_rank), int(cfg.launch.nnodes)
    if node_rank != 0:
        write_json_atomic(run_dir.file(f"summary.node{node_rank}.json"), summary)
        return
    if nnodes > 1 and result.status == "failed":
        name_failed_node(summary, result, node_identity()["node"], run_dir.path, nnodes)
    run_dir.write_summary(summary)


def _start_checks(cfg: Any, spec: JobSpec, run_dir: RunDir, gate: Gate, sampler: MemorySampler):
    # Imported here, after the launcher: the checks' modules (DeepSpeed, the planner) load beside the workers'
    # imports instead of before the workers start.
    from zerotune.launch.checks import JobChecks

    return JobChecks(cfg, spec, run_dir, gate, sampler).start()


def settled_launch(cfg: Any, spec: JobSpec, run_dir: RunDir, held: ExitStack) -> Any:
    """What to start, before anything starts: the launch block with the user's accelerate config folded in (it
    may set the process count), checked; and the checkpoint dir's lock, held until the workers are done.
    A refusal is recorded in summary.json and raised: no worker starts."""
    try:
        check_launch(cfg.launch)
        # In place; preflight folds the same files again, to the same values, and says their warnings.
        resolve(cfg, spec.overrides, quiet=True)
        check_launch(cfg.launch)
        if cfg.launch.node_rank == 0:  # one lock per job: its other nodes write their shards into the same dir
            held.enter_context(checkpoints.job_lock(cfg.checkpoint, run_dir.path))
    except ConfigError as exc:
        record_refusal(cfg, spec, run_dir, exc)
        raise
    return copy.deepcopy(cfg.launch)  # the checks go on changing cfg in their thread


def plan_only(cfg: Any, spec: JobSpec, run_dir: RunDir) -> dict:
    """plan.only=true: the checks and the prediction, no training; summary.json says "planned"."""
    from zerotune.launch import planning
    from zerotune.preflight import preflight

    try:
        gpu = planning.job_gpu(cfg)
        checked = preflight(cfg, overrides=spec.overrides)
    except ConfigError as exc:
        record_refusal(cfg, spec, run_dir, exc)
        raise
    run_dir.write_config(cfg)
    run_dir.write_ds_config(checked.ds_config)
    summary = {**base_summary(cfg, spec), "status": "planned", "config_sources": checked.config_sources,
               "config_warnings": checked.config_warnings,
               "plan": planning.job_plan(cfg, checked, gpu), "env": environment_info()}
    run_dir.write_summary(summary)
    return summary


def _skipped(run_dir: RunDir, base: dict) -> dict:
    """plan.guard=skip: the job is recorded as predicted to run out of GPU memory, and not run."""
    summary = {**base, "status": "predicted_oom", "env": environment_info()}
    run_dir.write_summary(summary)
    return summary


def _workers_summary(cfg: Any, run_dir: RunDir, base: dict, result) -> dict:
    """The summary to complete: rank 0's own, or this node's."""
    node_rank = cfg.launch.node_rank
    if node_rank != 0:
        # Rank 0, on node 0, writes the job's summary.json (over a shared file system, this same folder);
        # this node records its own ranks' outcome beside it, in summary.node<k>.json.
        return {**base, "status": "ok" if result.status == "ok" else "failed", "node_rank": node_rank,
                "node": node_identity()["node"],
                "note": "the job's summary.json is written by node 0", "env": environment_info()}
    return run_dir.read_summary() or {**base, "env": environment_info()}


def apply_slurm_geometry(cfg: Any, run_dir: str) -> None:
    """Inside a SLURM job started by hydra/launcher=slurm: nodes, node rank, master and GPUs from SLURM; a
    requeued attempt continues the job's newest checkpoint."""
    from omegaconf import OmegaConf, open_dict

    if not in_slurm_job(os.environ, cfg.launch.get("slurm", "auto")):
        return
    mapped = launch_from_slurm(OmegaConf.to_container(cfg.launch, resolve=True))
    with open_dict(cfg):
        for key, value in mapped.items():  # key by key: the node is typed (schema Launch), a dict is refused
            cfg.launch[key] = value
    log.info("SLURM job %s: node %s of %s, master %s:%s, %s workers on this node", os.environ["SLURM_JOB_ID"],
             mapped["node_rank"], mapped["nnodes"], mapped["master_addr"], mapped["master_port"],
             mapped["num_processes"])
    continue_requeued(cfg, run_dir)

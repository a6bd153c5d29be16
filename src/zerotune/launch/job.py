"""A job, as the Hydra process sees it: check the config, start the workers, record what happened.

Whatever the workers do (finish, raise, run out of memory, hang, get killed), the job's
summary.json ends with a status and the peak memory the job reached, and the process that
runs the sweep carries on to the next job.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from zerotune import checkpoints
from zerotune.errors import ConfigError
from zerotune.launch import planning
from zerotune.launch.elastic import LaunchResult, check_launch, launch_workers
from zerotune.launch.ops import prebuild_ops
from zerotune.launch.slurm import in_slurm_job, launch_from_slurm
from zerotune.preflight import CheckedRun, preflight
from zerotune.rundir import RunDir, write_json_atomic
from zerotune.rundir.spec import JobSpec
from zerotune.rundir.summary import experiment_info, key_choices, per_rank_summary, read_rank_records
from zerotune.schema import launch_world_size
from zerotune.telemetry import MemorySampler, environment_info
from zerotune.telemetry.startup import ParentMarks, startup_view

log = logging.getLogger("zerotune")


def run_job(cfg: Any, spec: JobSpec) -> dict:
    """The parent side of a job: its workers train (launch/worker.py); this process watches and records."""
    marks = ParentMarks()
    marks.mark("compose_and_imports")  # this process's start to here: Python, Hydra, zerotune's imports
    apply_slurm_geometry(cfg)
    run_dir = RunDir(spec.run_dir)
    run_dir.write_config(cfg)
    if cfg.plan.only:
        return plan_only(cfg, spec, run_dir)
    held = ExitStack()  # the checkpoint dir's lock, from the checks until the workers are done
    with held:
        checked = checked_job(cfg, spec, run_dir, held)
        marks.mark("checks")
        base = {**base_summary(cfg, spec), "config_sources": checked.config_sources,
                "plan": planning.job_plan(cfg, checked, planning.job_gpu(cfg))}
        marks.mark("plan")
        if planning.guard(cfg, base["plan"]) == "predicted_oom":
            return _skipped(run_dir, base)
        node_rank = cfg.launch.node_rank
        run_dir.write_ds_config(checked.ds_config)
        # Before the job's memory sampler: DeepSpeed's one-off JIT compile is not this configuration's cost.
        try:
            base["ops_build"] = prebuild_ops(checked.ds_config, checked.use_deepspeed)
        except ConfigError as exc:
            record_refusal(cfg, spec, run_dir, exc)
            raise
        marks.mark("ops_build")
        summary, result, peaks = _launch(cfg, run_dir, base)
        summary.update({k: base[k] for k in ("ops_build", "plan")})  # rank 0's own summary replaces base
        summary["startup"] = startup_view(marks, summary.get("startup_marks"))
    summary = merge_job_view(summary, result, peaks, run_dir.path)
    if node_rank != 0:
        write_json_atomic(run_dir.file(f"summary.node{node_rank}.json"), summary)
    else:
        run_dir.write_summary(summary)
    return summary


def checked_job(cfg: Any, spec: JobSpec, run_dir: RunDir, held: ExitStack) -> CheckedRun:
    """Everything that fails in seconds, before any worker starts: the config, the user's files, the checkpoint
    to resume, the checkpoint dir's lock. A refusal is recorded in summary.json and raised."""
    try:
        # The user's DeepSpeed JSON / accelerate config are folded into cfg here (world size included),
        # so everything below reads what will run.
        check_launch(cfg.launch)
        checked = preflight(cfg, overrides=spec.overrides, run_dir=spec.run_dir)
        check_launch(cfg.launch)  # again: an accelerate config may have set it
        planning.job_gpu(cfg)  # a card the planner does not know
        held.enter_context(checkpoints.job_lock(cfg.checkpoint, run_dir.path))
    except ConfigError as exc:
        record_refusal(cfg, spec, run_dir, exc)
        raise
    # The workers take this process's findings: the checkpoint it chose, its files checksummed once (here,
    # not once per rank), and that the checkpoint dir's lock is held.
    spec.from_parent = True
    if checked.resume is not None:
        cfg.resume.path = spec.resume_verified = str(checked.resume.path)
    run_dir.write_config(cfg)
    spec.save()
    return checked


def plan_only(cfg: Any, spec: JobSpec, run_dir: RunDir) -> dict:
    """plan.only=true: the checks and the prediction, no training; summary.json says "planned"."""
    try:
        gpu = planning.job_gpu(cfg)
        checked = preflight(cfg, overrides=spec.overrides)
    except ConfigError as exc:
        record_refusal(cfg, spec, run_dir, exc)
        raise
    run_dir.write_config(cfg)
    run_dir.write_ds_config(checked.ds_config)
    summary = {**base_summary(cfg, spec), "status": "planned", "config_sources": checked.config_sources,
               "plan": planning.job_plan(cfg, checked, gpu), "env": environment_info()}
    run_dir.write_summary(summary)
    return summary


def _skipped(run_dir: RunDir, base: dict) -> dict:
    """plan.guard=skip: the job is recorded as predicted to run out of GPU memory, and not run."""
    summary = {**base, "status": "predicted_oom", "env": environment_info()}
    run_dir.write_summary(summary)
    return summary


def record_refusal(cfg: Any, spec: JobSpec, run_dir: RunDir, exc: ConfigError) -> None:
    """A job refused before any worker started still has its summary.json, naming the key."""
    run_dir.write_summary({**base_summary(cfg, spec), "error": {"type": type(exc).__name__, "key": exc.key,
                                                                 "message": str(exc)}, "env": environment_info()})


def _launch(cfg: Any, run_dir: RunDir, base: dict) -> tuple[dict, LaunchResult, dict]:
    """Start the workers and wait; the summary to complete (rank 0's own, or this node's), the launcher's
    outcome and the memory peaks of the whole process tree."""
    nvme = cfg.offload.path if cfg.offload.device == "nvme" else None
    # The job's own view of memory: every worker on this node, whatever becomes of them.
    with MemorySampler(nvme_dir=nvme, include_root=False) as sampler:
        result = launch_workers(cfg.launch, run_dir.path, cfg.train.timeout_s)
    node_rank = cfg.launch.node_rank
    if node_rank != 0:
        # Rank 0, on node 0, writes the job's summary.json (over a shared file system, this same folder);
        # this node records its own ranks' outcome beside it, in summary.node<k>.json.
        summary = {**base, "status": "ok" if result.status == "ok" else "failed", "node_rank": node_rank,
                   "note": "the job's summary.json is written by node 0", "env": environment_info()}
    else:
        summary = run_dir.read_summary() or {**base, "env": environment_info()}
    return summary, result, sampler.peaks()


def base_summary(cfg: Any, spec: JobSpec) -> dict:
    """What the job's summary says before (or without) the workers' own."""
    return {"status": "failed", "choices": key_choices(cfg, launch_world_size(cfg.launch)),
            "run_dir": spec.run_dir, "experiment": experiment_info(cfg),
            "previous_attempts": RunDir(spec.run_dir).previous_attempts(), "checkpoint_dir": _checkpoint_dir(cfg, spec)}


def _checkpoint_dir(cfg: Any, spec: JobSpec) -> str:
    return str(checkpoints.checkpoint_root(cfg.checkpoint.dir, Path(spec.run_dir)))


def _last_checkpoint(summary: dict) -> None:
    """A job whose workers died without a summary still says which checkpoint it can resume from."""
    found = checkpoints.latest(Path(summary["checkpoint_dir"])) if summary.get("checkpoint_dir") else None
    summary.setdefault("checkpoint", {}).setdefault("last_complete", str(found) if found else None)


def apply_slurm_geometry(cfg: Any) -> None:
    """Inside a SLURM job started by hydra/launcher=slurm: nodes, node rank, master and GPUs from SLURM."""
    from omegaconf import OmegaConf, open_dict

    if not in_slurm_job(os.environ, cfg.launch.get("slurm", "auto")):
        return
    mapped = launch_from_slurm(OmegaConf.to_container(cfg.launch, resolve=True))
    with open_dict(cfg):
        cfg.launch = mapped
    log.info("SLURM job %s: node %s of %s, master %s:%s, %s workers on this node", os.environ["SLURM_JOB_ID"],
             mapped["node_rank"], mapped["nnodes"], mapped["master_addr"], mapped["master_port"],
             mapped["num_processes"])


def merge_job_view(summary: dict, result: LaunchResult, peaks: dict, run_dir: Path) -> dict:
    """Fold the launcher's outcome and the whole-tree memory peaks into the workers' summary."""
    if result.status == "interrupted":
        # The workers stopped on the signal the launcher passed on (their summary says so), or were killed
        # before they could write it.
        summary["status"] = "interrupted"
        summary.setdefault("interrupted", {"signal": result.signal, "after_step": summary.get("steps")})
    elif result.status != "ok" and summary.get("status") in ("ok", "failed", None):
        # A worker's own "oom" stays; a timeout or a death the worker could not record is the launcher's.
        if result.status == "timeout" or "error" not in summary:
            summary["status"] = result.status
            summary["error"] = {"type": result.status, "message": result.error,
                                "log_tail": log_tail(run_dir, local_rank=result.failed_local_rank)}
        elif result.failed_rank not in (None, 0):
            # Rank 0 recorded what it saw (often a peer's closed connection); the cause is the rank that
            # failed first: its error leads, rank 0's stays beside it.
            summary["status"] = "failed"
            summary["error"] = {"type": "failed", "message": result.error, "failed_rank": result.failed_rank,
                                "rank0_error": summary["error"],
                                "log_tail": log_tail(run_dir, local_rank=result.failed_local_rank)}
    _last_checkpoint(summary)
    memory = summary.setdefault("memory", {})
    memory["host_peak_rss_mib"] = peaks["host_peak_rss_mib"]  # all ranks, not just rank 0
    if peaks["nvme_peak_mib"] is not None:
        memory["nvme_peak_mib"] = max(peaks["nvme_peak_mib"], memory.get("nvme_peak_mib") or 0.0)
    for key in ("gpu_peak_process_mib", "gpu_peak_device_mib"):
        if memory.get(key) is None and peaks[key] is not None:
            memory[key] = peaks[key]  # the worker died before writing its own figures
    files = per_rank_summary(read_rank_records(run_dir))
    # Rank 0 gathered every rank's record over torch.distributed (all nodes); this node's files are a
    # subset, and the only record when the job failed before the gather.
    if len(files.get("per_rank", [])) >= len(memory.get("per_rank") or []):
        memory.update(files)
    return summary


def log_tail(run_dir: Path, lines: int = 30, local_rank: int | None = None) -> list[str]:
    """The last lines a worker wrote to stderr (the launcher keeps one log per rank): the failed rank's
    when known, else the latest written."""
    pattern = f"**/{local_rank}/stderr.log" if local_rank is not None else "**/stderr.log"
    logs = sorted((run_dir / "logs").glob(pattern), key=lambda p: p.stat().st_mtime)
    if not logs:
        return []
    return logs[-1].read_text(errors="replace").splitlines()[-lines:]

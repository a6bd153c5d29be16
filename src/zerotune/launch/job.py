"""A job, as the Hydra process sees it: check the config, start the workers, record what happened.

Whatever the workers do (finish, raise, run out of memory, hang, get killed), the job's
summary.json ends with a status and the peak memory the job reached, and the process that
runs the sweep carries on to the next job.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from zerotune.errors import ConfigError
from zerotune.launch.elastic import check_launch, launch_workers
from zerotune.launch.slurm import in_slurm_job, launch_from_slurm
from zerotune.preflight import preflight
from zerotune.rundir import RunDir, write_json_atomic
from zerotune.rundir.spec import JobSpec
from zerotune.rundir.summary import experiment_info, key_choices, per_rank_summary, read_rank_records
from zerotune.schema import launch_world_size
from zerotune.telemetry import MemorySampler, environment_info

log = logging.getLogger("zerotune")


def run_job(cfg: Any, spec: JobSpec) -> dict:
    """The parent side of a job: its workers train (launch/worker.py); this process watches and records."""
    apply_slurm_geometry(cfg)
    run_dir = RunDir(spec.run_dir)
    run_dir.write_config(cfg)
    spec.save()
    try:
        # Fails in seconds, before any worker starts. The user's DeepSpeed JSON / accelerate config are folded
        # into cfg here (world size included), so everything below reads what will run.
        check_launch(cfg.launch)
        checked = preflight(cfg, overrides=spec.overrides)
        check_launch(cfg.launch)  # again: an accelerate config may have set it
    except ConfigError as exc:
        run_dir.write_summary({**base_summary(cfg, spec), "error": {"type": "ConfigError", "key": exc.key,
                                                                     "message": str(exc)},
                               "env": environment_info()})
        raise
    run_dir.write_config(cfg)
    base = {**base_summary(cfg, spec), "config_sources": checked.config_sources}
    node_rank = cfg.launch.node_rank
    run_dir.write_ds_config(checked.ds_config)
    nvme = cfg.offload.path if cfg.offload.device == "nvme" else None
    # The job's own view of memory: every worker on this node, whatever becomes of them.
    with MemorySampler(nvme_dir=nvme, include_root=False) as sampler:
        result = launch_workers(cfg.launch, run_dir.path, cfg.train.get("timeout_s"))
    if node_rank != 0:
        # Rank 0, on node 0, writes the job's summary.json (over a shared file system, this same folder);
        # this node records its own ranks' outcome beside it, in summary.node<k>.json.
        summary = {**base, "status": "ok" if result.status == "ok" else "failed", "node_rank": node_rank,
                   "note": "the job's summary.json is written by node 0", "env": environment_info()}
    else:
        summary = run_dir.read_summary() or {**base, "env": environment_info()}
    summary = merge_job_view(summary, result.status, result.error, sampler.peaks(), run_dir.path,
                             failed_rank=result.failed_rank, failed_local_rank=result.failed_local_rank)
    if node_rank != 0:
        write_json_atomic(run_dir.file(f"summary.node{node_rank}.json"), summary)
    else:
        run_dir.write_summary(summary)
    return summary


def base_summary(cfg: Any, spec: JobSpec) -> dict:
    """What the job's summary says before (or without) the workers' own."""
    return {"status": "failed", "choices": key_choices(cfg, launch_world_size(cfg.launch)),
            "run_dir": spec.run_dir, "experiment": experiment_info(cfg)}


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


def merge_job_view(summary: dict, launch_status: str, launch_error: str | None, peaks: dict,
                   run_dir: Path, failed_rank: int | None = None, failed_local_rank: int | None = None) -> dict:
    """Fold the launcher's outcome and the whole-tree memory peaks into the workers' summary."""
    if launch_status != "ok" and summary.get("status") in ("ok", "failed", None):
        # A worker's own "oom" stays; a timeout or a death the worker could not record is the launcher's.
        if launch_status == "timeout" or "error" not in summary:
            summary["status"] = launch_status
            summary["error"] = {"type": launch_status, "message": launch_error,
                                "log_tail": log_tail(run_dir, local_rank=failed_local_rank)}
        elif failed_rank not in (None, 0):
            # Rank 0 recorded what it saw (often a peer's closed connection); the cause is the rank that
            # failed first: its error leads, rank 0's stays beside it.
            summary["status"] = "failed"
            summary["error"] = {"type": "failed", "message": launch_error, "failed_rank": failed_rank,
                                "rank0_error": summary["error"],
                                "log_tail": log_tail(run_dir, local_rank=failed_local_rank)}
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

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
from zerotune.launch.elastic import launch_workers
from zerotune.launch.spec import JobSpec
from zerotune.plan import make_plan
from zerotune.rundir import RunDir
from zerotune.telemetry import MemorySampler, environment_info
from zerotune.training.run import experiment_info, key_choices, train

log = logging.getLogger("zerotune")


def launched_externally() -> bool:
    """torchrun, `accelerate launch` and `deepspeed` start every rank themselves and set RANK."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size(cfg: Any) -> int:
    return int(cfg.launch.num_processes) * int(cfg.launch.nnodes)


def run_job(cfg: Any, spec: JobSpec) -> dict:
    if launched_externally():
        return train(cfg, spec)  # this process is one rank already
    run_dir = RunDir(spec.run_dir)
    run_dir.write_config(cfg)
    spec.save()
    base = {"status": "failed", "choices": {**key_choices(cfg), "world_size": world_size(cfg)},
            "run_dir": spec.run_dir, "experiment": experiment_info(cfg)}
    try:
        plan = make_plan(cfg, world_size(cfg))  # fail in seconds, before any worker starts
    except ConfigError as exc:
        run_dir.write_summary({**base, "error": {"type": "ConfigError", "key": exc.key, "message": str(exc)},
                               "env": environment_info()})
        raise
    run_dir.write_ds_config(plan.ds_config)
    nvme = cfg.offload.path if cfg.offload.device == "nvme" else None
    # The job's own view of memory: every worker on this node, whatever becomes of them.
    with MemorySampler(nvme_dir=nvme, include_root=False) as sampler:
        result = launch_workers(cfg.launch, run_dir.path, cfg.train.get("timeout_s"))
    summary = run_dir.read_summary()
    if summary is None and int(cfg.launch.node_rank) != 0 and result.status == "ok":
        # Another node's rank 0 writes the job's summary; this node records its own ranks' outcome.
        summary = {**base, "status": "ok", "node_rank": int(cfg.launch.node_rank),
                   "note": "the job's summary is written on node 0", "env": environment_info()}
    summary = summary or {**base, "env": environment_info()}
    summary = merge_job_view(summary, result.status, result.error, sampler.peaks(), run_dir.path)
    run_dir.write_summary(summary)
    return summary


def merge_job_view(summary: dict, launch_status: str, launch_error: str | None, peaks: dict,
                   run_dir: Path) -> dict:
    """Fold the launcher's outcome and the whole-tree memory peaks into the workers' summary."""
    if launch_status != "ok" and summary.get("status") in ("ok", "failed", None):
        # A worker's own "oom" stays; a timeout or a death the worker could not record is the launcher's.
        if launch_status == "timeout" or "error" not in summary:
            summary["status"] = launch_status
            summary["error"] = {"type": launch_status, "message": launch_error,
                                "log_tail": log_tail(run_dir)}
    memory = summary.setdefault("memory", {})
    memory["host_peak_rss_mib"] = peaks["host_peak_rss_mib"]  # all ranks, not just rank 0
    if peaks["nvme_peak_mib"] is not None:
        memory["nvme_peak_mib"] = max(peaks["nvme_peak_mib"], memory.get("nvme_peak_mib") or 0.0)
    for key in ("gpu_peak_process_mib", "gpu_peak_device_mib"):
        if memory.get(key) is None and peaks[key] is not None:
            memory[key] = peaks[key]  # the worker died before writing its own figures
    files = per_rank_memory(run_dir)
    # Rank 0 gathered every rank's record over torch.distributed (all nodes); this node's files are a
    # subset, and the only record when the job failed before the gather.
    if len(files.get("per_rank", [])) >= len(memory.get("per_rank") or []):
        memory.update(files)
    return summary


def per_rank_memory(run_dir: Path) -> dict:
    import json

    files = sorted((run_dir / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return per_rank_summary([json.loads(f.read_text()) for f in files])


def per_rank_summary(ranks: list[dict]) -> dict:
    """Each rank's figures, and the largest per-process GPU peak among them."""
    if not ranks:
        return {}
    ranks = sorted(ranks, key=lambda r: int(r["rank"]))
    gpu = [r.get("gpu_peak_process_mib") for r in ranks]
    measured = [g for g in gpu if g is not None]
    host = [r["host_peak_rss_mib"] for r in ranks if r.get("host_peak_rss_mib") is not None]
    return {"per_rank": ranks, "gpu_peak_process_mib_max_rank": max(measured) if measured else None,
            "host_peak_rss_mib_max_rank": max(host) if host else None}


def log_tail(run_dir: Path, lines: int = 30) -> list[str]:
    """The last lines any worker wrote to stderr (the launcher keeps one log per rank)."""
    logs = sorted((run_dir / "logs").glob("**/stderr.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return []
    return logs[-1].read_text(errors="replace").splitlines()[-lines:]

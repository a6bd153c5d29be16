"""The pieces of a run's summary.json that both sides write: the job's parent and its training ranks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import OmegaConf

from zerotune.files import write_json_atomic
from zerotune.rundir.run_summary import JsonDict, RunSummary
from zerotune.schema import Config

log = logging.getLogger("zerotune")

RANKS = "ranks"  # <run dir>/ranks/rank<k>.json: each rank's own figures


def key_choices(cfg: Config, world_size: int) -> JsonDict:
    """The few choices that identify a configuration in reports and dashboards; the adapter as none, or its name
    and rank (lora-r16): what changes its size."""
    adapter = cfg.adapter
    adapter_choice = "none" if adapter is None or adapter.name == "none" else f"{adapter.name}-r{adapter.rank}"
    return {"zero_stage": cfg.zero_stage.stage, "offload": cfg.offload.device,
            "optimizer": cfg.optimizer.name, "scheduler": cfg.scheduler.name,
            "resolution": cfg.resolution.size, "batch_size": cfg.train.batch_size,
            "grad_accum": cfg.train.grad_accum, "precision": cfg.precision.name, "model": cfg.model.name,
            "data": cfg.data.name, "gradient_checkpointing": cfg.train.gradient_checkpointing,
            "world_size": world_size, "adapter": adapter_choice}


def experiment_info(cfg: Config) -> JsonDict | None:
    """An experiment's name and the reference figures it reproduces, for reports to compare against."""
    ref = cfg.reference
    if not ref:
        return None
    ref = dict(ref) if isinstance(ref, dict) else OmegaConf.to_container(ref, resolve=True)
    return {"name": ref.get("name"), "reference": ref}


def is_oom(exc: BaseException) -> bool:
    import torch

    # torch's CPU allocator raises a RuntimeError ("DefaultCPUAllocator: can't allocate memory", or "not enough
    # memory") where CUDA's raises OutOfMemoryError.
    message = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or any(
        words in message for words in ("out of memory", "can't allocate memory", "not enough memory"))


def write_rank_record(run_dir: Path, rank: int, record: JsonDict) -> JsonDict:
    """Every rank records its own figures; the job merges them (rank 0 alone would hide the others)."""
    folder = run_dir / RANKS
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, **record}
    write_json_atomic(folder / f"rank{rank}.json", record)
    return record


def read_rank_records(run_dir: Path) -> list[JsonDict]:
    files = sorted((run_dir / RANKS).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(f.read_text()) for f in files]


def per_rank_summary(ranks: list[JsonDict]) -> JsonDict:
    """Each rank's figures, and the largest per-process peaks among them."""
    if not ranks:
        return {}
    ranks = sorted(ranks, key=lambda r: int(r["rank"]))
    gpu = [r.get("gpu_peak_process_mib") for r in ranks]
    measured = [g for g in gpu if g is not None]
    host = [r["host_peak_rss_mib"] for r in ranks if r.get("host_peak_rss_mib") is not None]
    return {"per_rank": ranks, "gpu_peak_process_mib_max_rank": max(measured) if measured else None,
            "host_peak_rss_mib_max_rank": max(host) if host else None}


def print_result(summary: RunSummary, command_s: float | None = None) -> None:
    """The one line a person reads at the end of a run; `command_s`: seconds since the command's process began."""
    q, perf = summary.quality or {}, summary.perf or {}
    first, last = summary.loss_first, summary.loss_last
    parts = [f"status {summary.status}", f"steps {summary.steps}"]
    if first is not None and last is not None:
        parts.append(f"loss {first:.4f} -> {last:.4f}")
    if perf.get("step_time_median_s") is not None:
        parts.append(f"{perf['step_time_median_s']:.3f} s/step (median)")
    if "digit_accuracy" in q:
        parts.append(f"digit accuracy {100 * q['digit_accuracy']:.1f}%")
    plan = summary.plan
    if plan is not None and plan.gpu_peak_mib is not None:
        card = (plan.gpu or {}).get("name")
        parts.append(f"predicted GPU peak {plan.gpu_peak_mib:,.0f} MiB per rank" + (f" on {card}" if card else ""))
    wall = f"wall time {summary.wall_time_s or 0:.0f} s"
    parts.append(wall + (f" ({command_s:.0f} s since the command started)" if command_s is not None else ""))
    log.info("result: %s", ", ".join(parts))
    if summary.error:
        log.error("error: %s", json.dumps(summary.error.get("message")))
    log.info("run directory: %s", summary.run_dir)

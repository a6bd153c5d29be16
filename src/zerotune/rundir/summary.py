"""summary.json, typed: the status words (a StrEnum: a member is its word in JSON, f-strings and comparisons), the
one writer and reader of a run's summary (and a node's summary.node<k>.json), and the per-rank records. A field
left None is absent from the file unless set to None (written as null); keys this version does not know are kept."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import OmegaConf

from zerotune.config.files import jsonable, write_json_atomic
from zerotune.config.schema import Config
from zerotune.rundir.plan import Plan


class Status(StrEnum):
    OK = "ok"
    FAILED = "failed"
    OOM = "oom"                      # a worker's out-of-memory error, or the kernel's OOM killer (error.kind "host")
    TIMEOUT = "timeout"              # train.timeout_s, or SLURM's time limit
    INTERRUPTED = "interrupted"      # a stop signal: training ended after the current step
    PRUNED = "pruned"                # a tune trial its study stopped at a rung
    PLANNED = "planned"              # plan.only=true: the checks and the prediction, no training
    PREDICTED_OOM = "predicted_oom"  # plan.guard=skip: predicted not to fit, not run
    CANCELLED = "cancelled"          # SLURM cancelled the job before it recorded a result
    LOST = "lost"                    # a SLURM attempt that ended before it wrote any record

    @classmethod
    def parse(cls, value: object) -> Status | None:
        """The member a summary's word names; None for no word, or one this version does not know."""
        if not isinstance(value, str):
            return None
        try:
            return cls(value)
        except ValueError:
            return None


# A job that ended as it was asked to: its command exits 0.
SUCCEEDED = frozenset({Status.OK, Status.PLANNED, Status.PRUNED})
# Ends that the launcher records over the workers' own word (job/records.py).
LAUNCHER_OVERRIDES = frozenset({Status.OK, Status.FAILED})
# A multi-node SLURM job that ended so: node 0's task exits non-zero, so srun ends the other nodes' tasks.
ENDS_THE_STEP = frozenset({Status.FAILED, Status.OOM, Status.TIMEOUT})
# A summary the job itself wrote with one of these keeps it when SLURM's account is added: it is the more precise.
FINAL = frozenset({Status.OK, Status.FAILED, Status.OOM, Status.TIMEOUT, Status.PLANNED, Status.PREDICTED_OOM})


SUMMARY = "summary.json"

JsonDict = dict[str, Any]  # a nested block of the summary, as JSON has it


class NotAnObject(ValueError):
    """A summary file that is JSON, but not an object."""


def node_summary_name(node_rank: int) -> str:
    """The summary a node other than 0 writes beside node 0's summary.json (job/records.py reads it)."""
    return SUMMARY if node_rank == 0 else f"summary.node{node_rank}.json"


@dataclass(eq=False)
class RunSummary:
    status: Status | None = None
    choices: JsonDict | None = None         # rundir/summary.py key_choices
    run_dir: str | None = None
    experiment: JsonDict | None = None      # the experiment's name and its reference figures
    previous_attempts: list[str] | None = None
    checkpoint_dir: str | None = None
    slurm: JsonDict | None = None           # the SLURM job and attempt (job/slurm.py slurm_record)
    error: JsonDict | None = None           # type, message; key for a ConfigError; failed_rank, log_tail, ...
    config_sources: JsonDict | None = None
    config_warnings: list[str] | None = None
    plan: Plan | None = None                # the planner's prediction, or its error
    ops_build: JsonDict | None = None
    threads: JsonDict | None = None
    use_deepspeed: bool | None = None
    num_params: int | None = None
    trainable_params: int | None = None
    frozen_params: int | None = None
    node_rank: int | None = None            # summary.node<k>.json only
    node: str | None = None
    note: str | None = None
    steps: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    samples_seen: int | None = None
    epochs: int | None = None
    checkpoint: JsonDict | None = None      # saved, last_complete, final, resumed_from
    pruned: JsonDict | None = None
    interrupted: JsonDict | None = None     # signal, after_step, last_checkpoint; job_signal from the parent
    optimizer_class: str | None = None
    train_time_s: float | None = None
    ema: JsonDict | None = None
    memory: JsonDict | None = None          # peaks (MiB), per_rank, phases
    perf: JsonDict | None = None            # step times, throughput
    data: JsonDict | None = None
    partition: JsonDict | None = None
    quality: JsonDict | None = None
    validation: JsonDict | None = None      # prompts, passes (step, images, seconds, errors), memory
    wall_time_s: float | None = None
    startup_marks: JsonDict | None = None
    startup: JsonDict | None = None
    env: JsonDict | None = None
    extra: JsonDict = field(default_factory=dict)  # keys this version does not know, kept as read
    nulls: set[str] = field(default_factory=set)   # fields that are None and written as null

    _NOT_KEYS: ClassVar[frozenset[str]] = frozenset({"extra", "nulls"})

    def __setattr__(self, name: str, value: object) -> None:
        # As a dict's `summary[key] = None`: a field set to None after construction is written, as null.
        if value is None and "nulls" in self.__dict__:
            self.nulls.add(name)
        object.__setattr__(self, name, value)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in cls._NOT_KEYS]

    def update(self, values: JsonDict) -> None:
        """Set each key (a known one as its field, any other kept in `extra`)."""
        known = set(self.keys())
        for key, value in values.items():
            status = Status.parse(value) if key == "status" else None
            if key not in known or (key == "status" and value is not None and status is None):
                self.extra[key] = value  # a status word this version does not know, too: kept as written
            elif key == "plan" and isinstance(value, dict):  # as read from a file
                self.plan = Plan.from_dict(value)
            elif key == "plan" and value is not None and not isinstance(value, Plan):
                self.extra[key] = value  # not a plan (a file another tool wrote): kept as written
            else:
                setattr(self, key, status if key == "status" else value)

    def as_dict(self) -> JsonDict:
        """The keys the run has, its values as they are (to_json: as written)."""
        out: JsonDict = {}
        for key in self.keys():
            value = getattr(self, key)
            if value is not None or key in self.nulls:
                out[key] = value.to_dict() if isinstance(value, Plan) else value
        return {**out, **self.extra}

    def to_json(self) -> JsonDict:
        return jsonable(self.as_dict())

    @classmethod
    def from_json(cls, data: JsonDict) -> RunSummary:
        """A summary of these keys (one given as None is written as null); a key it lacks is None."""
        summary = cls()
        summary.update(data)
        return summary

    @classmethod
    def read(cls, run_dir: str | Path, name: str = SUMMARY) -> RunSummary | None:
        """The run folder's summary; None where there is none. A file that is not JSON raises ValueError."""
        file = Path(run_dir) / name
        if not file.is_file():
            return None
        data = json.loads(file.read_text())
        if not isinstance(data, dict):
            raise NotAnObject(f"{file} is not a JSON object")
        return cls.from_json(data)

    @classmethod
    def read_if_whole(cls, run_dir: str | Path, name: str = SUMMARY) -> RunSummary | None:
        """read, with a file that does not parse (a partial write from a killed process, one being written) as none."""
        try:
            return cls.read(run_dir, name)
        except (OSError, ValueError):
            return None

    def write(self, run_dir: str | Path, name: str = SUMMARY) -> None:
        write_json_atomic(Path(run_dir) / name, self.to_json())

    def trained_status(self) -> Status:
        """The status of a run that trained to its end: stopped by a signal, by its study, or complete."""
        if self.interrupted is not None:
            return Status.INTERRUPTED
        return Status.PRUNED if self.pruned is not None else Status.OK

    @property
    def error_type(self) -> str | None:
        return (self.error or {}).get("type")


log = logging.getLogger("zerotune")

RANKS = "ranks"  # <run dir>/ranks/rank<k>.json: each rank's own figures


def key_choices(cfg: Config, world_size: int) -> JsonDict:
    """The few choices that identify a configuration in reports and dashboards; the adapter as none or lora-r16."""
    adapter = cfg.adapter
    adapter_choice = "none" if adapter is None or adapter.name == "none" else \
        f"{adapter.name}-r{adapter.rank}" + ("-dora" if adapter.dora else "")
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

    # torch's CPU allocator raises a RuntimeError where CUDA's raises OutOfMemoryError.
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

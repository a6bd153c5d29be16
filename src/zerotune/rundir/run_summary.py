"""summary.json, typed: the one writer of a run's summary (and of a node's summary.node<k>.json) and the one
reader. A field left None is absent from the file, as the run never wrote it, unless it was set to None (a run
that measured nothing says `"loss_first": null`); keys this version does not know are kept as they were."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from zerotune.files import jsonable, write_json_atomic
from zerotune.rundir.plan import Plan
from zerotune.rundir.status import Status

SUMMARY = "summary.json"

JsonDict = dict[str, Any]  # a nested block of the summary, as JSON has it


class NotAnObject(ValueError):
    """A summary file that is JSON, but not an object."""


def node_summary_name(node_rank: int) -> str:
    """The summary a node other than 0 writes beside node 0's summary.json (launch/node_failures.py reads it)."""
    return SUMMARY if node_rank == 0 else f"summary.node{node_rank}.json"


@dataclass(eq=False)
class RunSummary:
    status: Status | None = None
    choices: JsonDict | None = None         # rundir/summary.py key_choices
    run_dir: str | None = None
    experiment: JsonDict | None = None      # the experiment's name and its reference figures
    previous_attempts: list[str] | None = None
    checkpoint_dir: str | None = None
    slurm: JsonDict | None = None           # the SLURM job and attempt (slurm/job.py slurm_record)
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
        """A summary of these keys: one given as None is written as null. An older summary reads too: a key it lacks
        is None, a key this version does not know is kept."""
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

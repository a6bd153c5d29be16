"""The planner's prediction as a typed record: what the planner returns and summary.json's `plan` holds, for its
readers (reports, the builder page, the tuner). `Plan.from_dict` reads one back; `to_dict` gives the same JSON."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from zerotune.config.schema import MIB

PERSISTENT = "persistent"  # a step term held throughout the step (written without a "moment")


@dataclass(frozen=True)
class Term:
    """One named figure of a plan: MiB, or seconds for a time term (`timed`); `moment`: the step moment it lives in
    (None: written without one). `where`, `bound` (an upper bound) and `overlaps` describe the planner's DeepSpeed
    buffers and are not written."""

    term: str
    mib: float | None = None
    note: str = ""
    moment: str | None = None
    seconds: float | None = None
    timed: bool = False
    where: str = ""
    bound: str = ""
    overlaps: str = ""

    @classmethod
    def of_bytes(cls, name: str, nbytes: float, note: str = "", moment: str | None = None, *, where: str = "",
                 bound: str = "", overlaps: str = "") -> Term:
        return cls(name, nbytes / MIB, note, moment, where=where, bound=bound, overlaps=overlaps)

    @property
    def nbytes(self) -> int:
        """The figure in bytes (exact for a term made of bytes: dividing by a power of two loses nothing)."""
        return round((self.mib or 0.0) * MIB)

    @classmethod
    def timing(cls, name: str, seconds: float | None, note: str) -> Term:
        return cls(name, None, note, seconds=seconds, timed=True)

    @property
    def held_in(self) -> str:
        """The step's moment this term lives in: persistent when it names none."""
        return self.moment or PERSISTENT

    def to_dict(self) -> dict[str, Any]:
        figure: dict[str, Any] = {"seconds": self.seconds} if self.timed else {"mib": self.mib}
        return {"term": self.term, **figure, "note": self.note,
                **({"moment": self.moment} if self.moment is not None else {})}

    @classmethod
    def from_dict(cls, found: dict[str, Any]) -> Term:
        timed = "seconds" in found and "mib" not in found
        return cls(str(found["term"]), found.get("mib"), found.get("note", ""), found.get("moment"),
                   found.get("seconds"), timed)


def terms_of(found: Any) -> tuple[Term, ...]:
    return tuple(Term.from_dict(t) for t in found) if isinstance(found, list) else ()


def mib_of(terms: Iterable[Term]) -> float:
    """The terms' MiB together (a term of unknown size counts 0)."""
    return sum(t.mib or 0.0 for t in terms)


def at_peak(terms: Sequence[Term], moment: str | None) -> list[Term]:
    """The terms held at the step's `moment`: those held throughout and that moment's own."""
    return [t for t in terms if t.held_in in (PERSISTENT, moment)]


@dataclass(frozen=True)
class Phase:
    """One phase of the run as nvidia-smi shows it (plan/phases.py): its peak from an empty pool, its terms, what
    earlier phases left reserved, and what it shows."""

    phase: str                            # caching | adapter_injection | loading | step | sampling | export
    peak_mib: float
    terms: tuple[Term, ...]
    source: str
    end_live_mib: float | None = None     # an empty_cache() at its end: what stays reserved (not written)
    freed_at_end_mib: float | None = None  # ZeRO-1/2's loading: what that empty_cache() returns
    carried_mib: float = 0.0
    reserved_mib: float = 0.0
    run_peak: bool = False                # the phase that gives the run's peak

    def to_dict(self) -> dict[str, Any]:
        freed = {} if self.freed_at_end_mib is None else {"freed_at_end_mib": self.freed_at_end_mib}
        return {"phase": self.phase, "peak_mib": self.peak_mib, "terms": [t.to_dict() for t in self.terms],
                **freed, "source": self.source, "carried_mib": self.carried_mib, "reserved_mib": self.reserved_mib,
                "run_peak": self.run_peak}

    @classmethod
    def from_dict(cls, found: dict[str, Any]) -> Phase:
        return cls(str(found.get("phase")), float(found.get("peak_mib") or 0.0), terms_of(found.get("terms")),
                   str(found.get("source", "")), None, found.get("freed_at_end_mib"),
                   float(found.get("carried_mib") or 0.0), float(found.get("reserved_mib") or 0.0),
                   bool(found.get("run_peak")))


@dataclass(frozen=True)
class ProcessPrediction:
    """A node's predicted peak RSS (plan/host_memory.py): parent + ranks × (import baseline + tensors), each a
    term; `mib` is None where one of them is unknown (never a guess)."""

    mib: float | None
    terms: tuple[Term, ...]
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"mib": self.mib, "terms": [t.to_dict() for t in self.terms], "source": self.source}

    @classmethod
    def from_dict(cls, found: Any) -> ProcessPrediction | None:
        if not isinstance(found, dict):
            return None
        return cls(found.get("mib"), terms_of(found.get("terms")), str(found.get("source", "")))


_TERM_LISTS = ("gpu_terms", "host_terms", "nvme_terms", "step_terms", "time_terms", "sampling_pass_terms")


@dataclass(frozen=True)
class Plan:
    """summary.json's `plan`: one job's prediction per rank (plan/predict.py), or the planner's `error`.
    Absent keys read as None (or no terms); `keys` keeps which were there, and in what order."""

    error: str | None = None
    workload: str | None = None
    device: str | None = None
    trainable_params: int | None = None
    frozen_params: int | None = None
    gpu: dict[str, Any] | None = None
    world_size: int | None = None
    rank: int | None = None
    trace: dict[str, Any] | None = None                   # the activation trace's cache key and its seconds
    gpu_peak_mib: float | None = None
    step_peak_mib: float | None = None
    step_peak_moment: str | None = None
    run_peak_mib: float | None = None
    run_peak_phase: str | None = None
    fits: bool | None = None
    host_peak_mib: float | None = None
    host_peak_kind: str | None = None
    nvme_mib: float | None = None
    time_floor_s: float | None = None
    bound: str | None = None
    gpu_terms: tuple[Term, ...] = ()
    host_terms: tuple[Term, ...] = ()
    nvme_terms: tuple[Term, ...] = ()
    step_terms: tuple[Term, ...] = ()
    time_terms: tuple[Term, ...] = ()
    sampling_pass_terms: tuple[Term, ...] = ()            # what one validation pass adds to the step's memory
    phases: tuple[Phase, ...] = ()
    host_fit: dict[str, Any] | None = None
    host_process_terms: ProcessPrediction | None = None
    micro_batch: dict[str, Any] | None = None             # `zerotune plan`'s answer: which batch was planned
    extra: dict[str, Any] = field(default_factory=dict)   # the keys this record does not type, as written
    keys: tuple[str, ...] = ()

    @classmethod
    def made(cls, **values: Any) -> Plan:
        """The planner's plan with these fields, written in this order (term lists as tuples of Term)."""
        return cls(**_as_fields(values), keys=tuple(values))

    def adding(self, **values: Any) -> Plan:
        """This plan with these fields set: a field already written keeps its place, a new one is written last."""
        return replace(self, **_as_fields(values), keys=self.keys + tuple(k for k in values if k not in self.keys))

    @classmethod
    def from_dict(cls, found: Any) -> Plan | None:
        """The plan of a summary read from a file (None where it has none: runs older than the planner)."""
        if not isinstance(found, dict):
            return None
        typed = {f.name for f in fields(cls)} - {"extra", "keys"}
        values: dict[str, Any] = {}
        for key, value in found.items():
            if key in _TERM_LISTS:
                values[key] = terms_of(value)
            elif key == "phases":
                values[key] = tuple(Phase.from_dict(p) for p in value) if isinstance(value, list) else ()
            elif key == "host_process_terms":
                values[key] = ProcessPrediction.from_dict(value)
            elif key in typed:
                values[key] = value
        extra = {k: v for k, v in found.items() if k not in typed}
        return cls(**values, extra=extra, keys=tuple(found))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in self.keys:
            if key in self.extra:
                out[key] = self.extra[key]
            elif key in _TERM_LISTS:
                out[key] = [t.to_dict() for t in getattr(self, key)]
            elif key == "phases":
                out[key] = [p.to_dict() for p in self.phases]
            elif key == "host_process_terms":
                out[key] = None if self.host_process_terms is None else self.host_process_terms.to_dict()
            else:
                out[key] = getattr(self, key)
        return out

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    @property
    def peak_mib(self) -> float | None:
        """What nvidia-smi would show at the run's peak: its phases' when known, else the step's."""
        if self.gpu_peak_mib is None:
            return self.run_peak_mib
        return max(self.run_peak_mib or 0.0, self.gpu_peak_mib)

    def terms_at_peak(self) -> list[Term]:
        """The GPU terms held at the step's largest moment."""
        return at_peak(self.gpu_terms, self.step_peak_moment)


def _as_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The planner's lists as the record's tuples."""
    return {k: tuple(v) if k in _TERM_LISTS or k == "phases" else v for k, v in values.items()}

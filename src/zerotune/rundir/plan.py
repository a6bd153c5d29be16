"""The planner's prediction as a record: what summary.json's `plan` holds, typed for its readers (the planner,
the reports, the builder page, the tuner). `Plan.from_dict(...).to_dict()` gives back the same JSON."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from zerotune.units import MIB

PERSISTENT = "persistent"  # a step term held throughout the step (written without a "moment")


@dataclass(frozen=True)
class Term:
    """One named figure of a plan: memory (MiB) or, for a time term (`timed`), seconds; with what it is
    (`note`) and, for the training step's terms, the moment it lives in (None: written without one).

    The planner's DeepSpeed buffers are terms too, with where they live (`where`: gpu | host), whether the
    figure is exact or an upper bound (`bound`) and the model state they share memory with (`overlaps`);
    their `moment` is DeepSpeed's lifetime of the buffer. These three are the planner's own: not written."""

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


def at_peak(terms: tuple[Term, ...], moment: str | None) -> list[Term]:
    """The terms held at the step's `moment`: those held throughout and that moment's own."""
    return [t for t in terms if t.held_in in (PERSISTENT, moment)]


_TERM_LISTS = ("gpu_terms", "host_terms", "nvme_terms", "step_terms", "time_terms")


@dataclass(frozen=True)
class Plan:
    """summary.json's `plan`: one job's prediction per rank (plan/predict.py), or the planner's `error`.
    Absent keys read as None (or no terms); `keys` keeps which were there, and in what order."""

    error: str | None = None
    workload: str | None = None
    device: str | None = None
    gpu: dict[str, Any] | None = None
    world_size: int | None = None
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
    phases: tuple[dict[str, Any], ...] = ()
    host_fit: dict[str, Any] | None = None
    host_process_terms: dict[str, Any] | None = None
    micro_batch: dict[str, Any] | None = None             # `zerotune plan`'s answer: which batch was planned
    extra: dict[str, Any] = field(default_factory=dict)   # the keys this record does not type, as written
    keys: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, found: Any) -> Plan | None:
        """The plan of a summary (None where it has none: runs older than the planner)."""
        if not isinstance(found, dict):
            return None
        typed = {f.name for f in fields(cls)} - {"extra", "keys"}
        values: dict[str, Any] = {}
        for key, value in found.items():
            if key in _TERM_LISTS:
                values[key] = terms_of(value)
            elif key == "phases":
                values[key] = tuple(value) if isinstance(value, list) else ()
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
                out[key] = list(self.phases)
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

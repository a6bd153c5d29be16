"""DeepSpeed's batch rule: train_batch_size = micro batch × accumulation × world size.

Any two determine the third. Each known value carries where it came from, so an inconsistent
triple is reported with the knob that keeps the user's global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotune.errors import ConfigError


@dataclass(frozen=True)
class Known:
    """One of the three batch values, where it came from, and how to change it there. The one check that
    each is a positive integer (preflight and the validator both build these)."""

    value: int
    origin: str              # "ds.json", "command line" or "default"
    key: str                 # where to change it: "train.grad_accum", or the DeepSpeed key in the file
    file: str | None = None  # the file that holds `key`, when it came from one

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 1:
            where = f" ({self.file})" if self.file else ""
            raise ConfigError(self.key, f"must be a positive integer, got {self.value!r}{where}",
                              self.change("1 or more" if self.file is None else "a whole number, or \"auto\""))

    def change(self, value: int | str) -> str:
        return f"{self.key}={value}" if self.file is None else f"set {self.key} to {value} in {self.file}"


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    total: int


def solve(micro: Known | None, accum: Known | None, total: Known | None, world: int,
          default_micro: Known, default_accum: Known) -> Batch:
    """Fill in what is missing; with fewer than two known, zerotune's defaults supply the rest."""
    if total is not None and micro is None and accum is None:
        accum = default_accum
    if micro is None and (total is None or accum is None):
        micro = default_micro
    if accum is None and total is None:
        accum = default_accum
    if total is None:
        return Batch(micro.value, accum.value, micro.value * accum.value * world)
    if micro is None:
        return Batch(_divide(total, accum, world, "train_micro_batch_size_per_gpu"), accum.value, total.value)
    if accum is None:
        return Batch(micro.value, _divide(total, micro, world, "gradient_accumulation_steps"), total.value)
    if micro.value * accum.value * world != total.value:
        # Prefer changing the accumulation, then the micro batch: both keep the global batch the user asked for.
        keeps = f" (keeps train_batch_size {total.value})"
        if total.value % (micro.value * world) == 0:
            fix = accum.change(total.value // (micro.value * world)) + keeps
        elif total.value % (accum.value * world) == 0:
            fix = micro.change(total.value // (accum.value * world)) + keeps
        else:
            fix = f"{total.change(micro.value * accum.value * world)}, or set it to \"auto\""
        raise ConfigError("train_batch_size", f"{total.value} ({total.origin}) != micro batch {micro.value} "
                          f"({micro.origin}) x gradient accumulation {accum.value} ({accum.origin}) x {world} "
                          f"process{'es' if world > 1 else ''}", fix)
    return Batch(micro.value, accum.value, total.value)


def _divide(total: Known, other: Known, world: int, missing: str) -> int:
    value, rest = divmod(total.value, other.value * world)
    if rest or value < 1:
        raise ConfigError("train_batch_size", f"{total.value} ({total.origin}) is not a multiple of "
                          f"{other.value} ({other.origin}) x {world} process{'es' if world > 1 else ''}, so "
                          f"{missing} has no whole value", f"change {total.key} or {other.key}"
                          f"{f' in {total.file}' if total.file else ''}")
    return value


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
        _positive_int(self.value, self.key, self.file)

    @classmethod
    def read(cls, value: object, origin: str, key: str, file: str | None = None) -> Known:
        """A value as a DeepSpeed dict or the config states it (anything), refused unless a positive integer."""
        return cls(_positive_int(value, key, file), origin, key, file)

    def change(self, value: int | str) -> str:
        return _change(self.key, self.file, value)


def _positive_int(value: object, key: str, file: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where = f" ({file})" if file else ""
        raise ConfigError(key, f"must be a positive integer, got {value!r}{where}",
                          _change(key, file, "1 or more" if file is None else "a whole number, or \"auto\""))
    return value


def _change(key: str, file: str | None, value: int | str) -> str:
    return f"{key}={value}" if file is None else f"set {key} to {value} in {file}"


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    total: int


def solve(micro: Known | None, accum: Known | None, total: Known | None, world: int,
          default_micro: Known, default_accum: Known) -> Batch:
    """Fill in what is missing; with fewer than two known, zerotune's defaults supply the rest."""
    if total is None:
        micro = default_micro if micro is None else micro
        accum = default_accum if accum is None else accum
        return Batch(micro.value, accum.value, micro.value * accum.value * world)
    if micro is None:
        accum = default_accum if accum is None else accum
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


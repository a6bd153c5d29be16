"""Checkpoints, by job: `run_saves` (when a run saves, its final checkpoint, what its summary says),
`store` (saving: crash-safe, published whole, keep_last), `resume` (loading into
the prepared engine), `convert` (across DeepSpeed changes; the only code that depends on DeepSpeed's
internals) and `swap` (NVMe swap folders a killed run left). Finding, checking and choosing checkpoints
needs no model and lives below, in zerotune/checkpoints/."""

from zerotune.training.checkpoint.convert import full_state
from zerotune.training.checkpoint.resume import Restored, load
from zerotune.training.checkpoint.store import SaveRequest, cleanup, save
from zerotune.training.checkpoint.swap import clean_stale_swap

__all__ = ["Restored", "SaveRequest", "clean_stale_swap", "cleanup", "full_state", "load", "save"]

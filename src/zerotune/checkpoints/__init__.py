"""Checkpoints: policy and I/O in one place.

Before any model exists (no torch): their layout (`layout`), the manifest that COMPLETE holds (`manifest`), which
one `resume` names (`select`) and whether this run can continue it (`decide`), the lock that keeps one job per
checkpoint dir (`lock`), and disk space (`space`); these are what this package exports.
With the model, imported by module (they import torch): when a run saves, its final checkpoint and what its
summary says (`run_saves`), saving, crash-safe, published whole, keep_last (`store`), loading into the prepared
engine (`resume`), across DeepSpeed changes, the only code that depends on DeepSpeed's internals (`convert`),
and the NVMe swap folders a killed run left (`swap`)."""

from zerotune.checkpoints.decide import ResumeDecision, conversion_mode, current_meta, decide_resume
from zerotune.checkpoints.layout import (
    COMPLETE,
    EMA_FILE,
    LATEST,
    META,
    checkpoint_root,
    find,
    is_complete,
    job_token,
    latest,
    list_complete,
    read_meta,
    step_dir,
    tmp_dir,
    unet_config,
)
from zerotune.checkpoints.lock import CheckpointDirLock, job_lock
from zerotune.checkpoints.select import resolve_resume
from zerotune.checkpoints.space import CheckpointSpaceError

__all__ = ["COMPLETE", "EMA_FILE", "LATEST", "META", "CheckpointDirLock", "CheckpointSpaceError", "ResumeDecision",
           "checkpoint_root", "conversion_mode", "current_meta", "decide_resume", "find", "is_complete", "job_lock",
           "job_token", "latest", "list_complete", "read_meta", "resolve_resume", "step_dir", "tmp_dir", "unet_config"]

"""Checkpoints, by job: `store` (the folders, crash-safe saving, keep_last), `resume` (which checkpoint,
whether and how this run continues it), `convert` (across DeepSpeed changes; the only code that depends
on DeepSpeed's internals) and `swap` (NVMe swap folders a killed run left)."""

from zerotune.training.checkpoint.convert import full_state
from zerotune.training.checkpoint.resume import (
    Restored,
    ResumeDecision,
    conversion_mode,
    current_meta,
    decide_resume,
    load,
    resolve_resume,
)
from zerotune.training.checkpoint.store import (
    COMPLETE,
    EMA_FILE,
    META,
    SaveRequest,
    checkpoint_root,
    cleanup,
    find,
    is_complete,
    latest,
    read_meta,
    save,
    step_dir,
    unet_config,
)
from zerotune.training.checkpoint.swap import clean_stale_swap

__all__ = ["COMPLETE", "EMA_FILE", "META", "ResumeDecision", "Restored", "SaveRequest", "checkpoint_root",
           "clean_stale_swap", "cleanup", "conversion_mode", "current_meta", "decide_resume", "find", "full_state",
           "is_complete", "latest", "load", "read_meta", "resolve_resume", "save", "step_dir", "unet_config"]

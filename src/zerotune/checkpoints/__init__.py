"""Checkpoint folders as files, before any model exists: their layout (`layout`), the manifest that
COMPLETE holds (`manifest`), which one `resume` names (`select`) and whether this run can continue it
(`decide`), the lock that keeps one job per checkpoint dir (`lock`), and disk space (`space`).
Saving and loading the training state itself is training/checkpoint/'s."""

from zerotune.checkpoints.decide import ResumeDecision, conversion_mode, current_meta, decide_resume
from zerotune.checkpoints.layout import (
    COMPLETE,
    EMA_FILE,
    LATEST,
    META,
    TMP_PREFIX,
    checkpoint_root,
    find,
    folder_bytes,
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

__all__ = ["COMPLETE", "EMA_FILE", "LATEST", "META", "TMP_PREFIX", "CheckpointDirLock", "CheckpointSpaceError",
           "ResumeDecision", "checkpoint_root", "conversion_mode", "current_meta", "decide_resume", "find",
           "folder_bytes", "is_complete", "job_lock", "job_token", "latest", "list_complete", "read_meta", "resolve_resume", "step_dir",
           "tmp_dir", "unet_config"]

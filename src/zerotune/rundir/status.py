"""A run's status, as summary.json says it. The one place the status words are spelled: a `StrEnum`, so a member
is its word in JSON, in f-strings and in comparisons with the strings of older summary files."""

from __future__ import annotations

from enum import StrEnum


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
# Ends that the launcher records over the workers' own word (launch/records.py).
LAUNCHER_OVERRIDES = frozenset({Status.OK, Status.FAILED})
# A multi-node SLURM job that ended so: node 0's task exits non-zero, so srun ends the other nodes' tasks.
ENDS_THE_STEP = frozenset({Status.FAILED, Status.OOM, Status.TIMEOUT})
# A summary the job itself wrote with one of these keeps it when SLURM's account is added: it is the more precise.
FINAL = frozenset({Status.OK, Status.FAILED, Status.OOM, Status.TIMEOUT, Status.PLANNED, Status.PREDICTED_OOM})

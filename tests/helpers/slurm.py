"""The sbatch script hydra/launcher=slurm would submit, rendered without a cluster (submitit's own writer); which
signals a process catches."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def submission(launcher: Mapping[str, Any]) -> tuple[dict, dict]:
    """submitit's executor arguments for a hydra.launcher block, mapped as hydra-submitit-launcher does."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params = {k: v for k, v in dict(launcher).items() if k != "_target_"}
    init = {"folder": params.pop("submitit_folder"), "slurm_max_num_timeout": params.pop("max_num_timeout")}
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    return init, {k if k in base else f"slurm_{k}": v for k, v in params.items()}


def sbatch_script(launcher: Mapping[str, Any], folder: str) -> str:
    """The sbatch file submitit would submit for this hydra.launcher block (nothing is submitted)."""
    from unittest import mock

    import submitit
    from submitit.slurm.slurm import SlurmExecutor

    _, params = submission(launcher)
    # SlurmExecutor refuses to exist where there is no `srun`; for a preview it needs none.
    with mock.patch.object(SlurmExecutor, "affinity", return_value=1):
        executor = submitit.AutoExecutor(cluster="slurm", folder=folder)
    executor.update_parameters(**params)
    return executor._executor._make_submission_file_text("python -u -m submitit.core._submit", "0")


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler of its own for `sig` now (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


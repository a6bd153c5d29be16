"""A real two-node SLURM cluster on this machine (scripts/slurm_local.sh), for the tests that submit to one.
Each pytest process brings up its own, in its own folder and on its own ports, and stops it by its pids."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import ROOT, cli_env

SCRIPT = ROOT / "scripts" / "slurm_local.sh"
NODES = ("zt-node1", "zt-node2")


@dataclass(frozen=True)
class Cluster:
    folder: Path
    conf: Path

    def env(self, **extra: str) -> dict:
        """The environment a user has after `export SLURM_CONF=...`."""
        return {**cli_env(), "SLURM_CONF": str(self.conf), **extra}

    def run(self, *cmd: str, timeout: int = 60) -> subprocess.CompletedProcess:
        """A SLURM client command (sinfo, squeue, scontrol, sbatch) against this cluster."""
        return subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout)


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    for binary in ("slurmctld", "slurmd", "sinfo"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (make setup installs slurmctld, slurmd and slurm-client)"
    if os.geteuid() != 0:
        return "the local cluster's daemons run as root"
    return None


def _script(action: str, folder: Path, port: int) -> subprocess.CompletedProcess:
    env = {**cli_env(), "ZEROTUNE_SLURM_DIR": str(folder), "ZEROTUNE_SLURM_PORT": str(port)}
    return subprocess.run([str(SCRIPT), action], env=env, capture_output=True, text=True, timeout=120)


def start(folder: Path) -> Cluster:
    """Up, with its nodes idle; ports chosen at random in a range nothing else here uses."""
    port = random.Random(os.getpid()).randrange(17000, 29000, 4)
    up = _script("up", folder, port)
    assert up.returncode == 0, up.stdout + up.stderr + _logs(folder)
    return Cluster(folder, folder / "slurm.conf")


def stop(cluster: Cluster) -> None:
    conf = cluster.conf.read_text()
    port = int(next(line.split("=")[1] for line in conf.splitlines() if line.startswith("SlurmctldPort=")))
    down = _script("down", cluster.folder, port)
    assert down.returncode == 0, down.stdout + down.stderr


def _logs(folder: Path) -> str:
    logs = [folder / "slurmctld.log", *(folder / node / "slurmd.log" for node in NODES)]
    return "".join(f"\n--- {log}\n{log.read_text()[-3000:]}" for log in logs if log.exists())

"""What a SLURM cluster offers, as `scontrol` reports it: its partitions and each node's CPUs, memory and GPUs.
It is the cluster's configuration, not its current load: a node that is down or busy now is still one of its
partition's nodes. slurm/request.py checks a request against it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from zerotune.errors import ConfigError

LAUNCHER = "hydra/launcher"
# scontrol retries an unreadable slurm.conf for a minute, and an unreachable controller for several seconds.
SCONTROL_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int
    memory_mib: int
    gpus: int
    gpu_types: tuple[str, ...] = ()   # gres types ("a100" in gpu:a100:4); empty where the gres names none


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    state: str
    max_time_min: int | None    # None: unlimited
    max_nodes: int | None       # None: unlimited
    hidden: bool = False


@dataclass(frozen=True)
class Cluster:
    partitions: tuple[Partition, ...]
    nodes: tuple[Node, ...]

    def partition(self, name: str) -> Partition | None:
        return next((p for p in self.partitions if p.name == name), None)

    def default(self) -> Partition | None:
        return next((p for p in self.partitions if p.default), None)

    def nodes_of(self, partition: str) -> list[Node]:
        return [n for n in self.nodes if partition in n.partitions]


# ---- scontrol's output -------------------------------------------------------------------------------------

# `scontrol show ... -o` prints one record a line as Key=Value pairs; a value may hold spaces (OS=Linux 6.1 #1 SMP)
# or '=' (CfgTRES=cpu=2,mem=1M), so a key is a word that follows whitespace and precedes '='.
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_]*)=")


def parse_records(text: str) -> list[dict[str, str]]:
    records = []
    for line in text.splitlines():
        keys = list(_KEY.finditer(line))
        if not keys:
            continue
        record = {}
        for i, key in enumerate(keys):
            end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
            record[key[1]] = line[key.end():end].strip()
        records.append(record)
    return records


def parse_time_min(value: str) -> int | None:
    """SLURM's time (MaxTime): UNLIMITED/INFINITE, minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, in whole
    minutes (rounded down: a limit of 90 seconds holds a 1-minute job, not a 2-minute one)."""
    value = value.strip()
    if value.upper() in ("UNLIMITED", "INFINITE", "NONE", "") or value.upper().startswith("N/A"):
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    elif len(parts) == 2:
        hours, (minutes, seconds) = 0, parts
    else:
        hours, minutes, seconds = 0, parts[0], 0
    return (int(days or 0) * 24 + hours) * 60 + minutes + seconds // 60


def parse_gres(value: str) -> tuple[int, tuple[str, ...]]:
    """The GPUs of a node's Gres: "gpu:4", "gpu:a100:4(S:0-1)", "gpu:a100:2,gpu:v100:2,shard:8", "(null)"."""
    count, types = 0, []
    for item in re.split(r",(?![^(]*\))", value):  # commas inside (S:0,1) belong to the item
        fields = re.sub(r"\(.*\)$", "", item.strip()).split(":")
        if fields[0] != "gpu" or len(fields) < 2:
            continue
        number = re.match(r"\d+", fields[-1])
        if number is None:
            continue
        count += int(number[0])
        if len(fields) >= 3:
            types.append(fields[1])
    return count, tuple(types)


def parse_int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def parse_nodes(text: str) -> list[Node]:
    """`scontrol show node -o`."""
    nodes = []
    for r in parse_records(text):
        if "NodeName" not in r:
            continue
        gpus, types = parse_gres(r.get("Gres", ""))
        # CPUEfctv: less the cores SLURM keeps
        cpus = parse_int(r.get("CPUEfctv")) or parse_int(r.get("CPUTot")) or 0
        partitions = tuple(p for p in r.get("Partitions", "").split(",") if p and p != "(null)")
        nodes.append(Node(r["NodeName"], partitions, cpus, parse_int(r.get("RealMemory")) or 0, gpus, types))
    return nodes


def parse_partitions(text: str) -> list[Partition]:
    """`scontrol --all show partition -o`."""
    return [Partition(r["PartitionName"], r.get("Default") == "YES", r.get("State", "UP").upper(),
                      parse_time_min(r.get("MaxTime", "UNLIMITED")), parse_int(r.get("MaxNodes")),
                      r.get("Hidden") == "YES")
            for r in parse_records(text) if "PartitionName" in r]


# ---- asking the cluster ------------------------------------------------------------------------------------

def _no_cluster(problem: str, fix: str | None = None) -> ConfigError:
    return ConfigError(LAUNCHER, f"hydra/launcher=slurm submits to a SLURM cluster, and {problem}",
                       fix or "run from a machine where `sinfo` answers (a cluster's login node; SLURM_CONF names "
                       "its slurm.conf), or run here without SLURM: drop hydra/launcher=slurm")


def scontrol(*args: str, env: Mapping[str, str] | None = None) -> str:
    env = dict(os.environ if env is None else env)
    exe = shutil.which("scontrol", path=env.get("PATH"))
    if exe is None:
        raise _no_cluster("`scontrol` is not on PATH (no SLURM client here)")
    conf = env.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        raise _no_cluster(f"SLURM_CONF={conf} is not a file",
                          "export SLURM_CONF=<the cluster's slurm.conf>, or unset it to use the default one")
    try:
        done = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise _no_cluster(f"`scontrol {' '.join(args)}` did not answer within {SCONTROL_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:300]
        raise _no_cluster(f"`scontrol {' '.join(args)}` failed: {said}")
    return done.stdout


def show_job(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o <id>`'s record, or None where scontrol is missing, fails or no longer knows the job (it
    forgets a finished one after MinJobAge): unlike `scontrol()`, for callers that go on without the answer."""
    try:
        records = parse_records(scontrol("show", "job", "-o", job_id))
    except (ConfigError, OSError, subprocess.SubprocessError):
        return None
    return records[0] if records else None


def read_cluster(env: Mapping[str, str] | None = None) -> Cluster:
    """The partitions (hidden ones too: sbatch accepts them) and nodes of the cluster SLURM_CONF (or SLURM's
    default configuration) names."""
    partitions = parse_partitions(scontrol("--all", "show", "partition", "-o", env=env))
    nodes = parse_nodes(scontrol("show", "node", "-o", env=env))
    return Cluster(tuple(partitions), tuple(nodes))

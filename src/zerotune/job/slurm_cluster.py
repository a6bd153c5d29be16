"""What a SLURM cluster offers as `scontrol` reports it (its configuration, not its load), and the request
hydra/launcher=slurm would make checked against it before submission: a request sbatch cannot place, or a time limit
short of the first checkpoint, is a config error naming the `hydra.launcher.*` key with a value that passes."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from zerotune.config.errors import ConfigError

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


# States in which a partition takes no new jobs (scontrol's words); a DOWN partition queues them.
CLOSED_STATES = ("DRAIN", "INACTIVE")


@dataclass(frozen=True)
class Request:
    """The part of conf/hydra/launcher/slurm.yaml that sbatch matches against the cluster (None: not asked)."""
    partition: str | None = None
    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    tasks_per_node: int = 1
    mem_gb: float | None = None
    timeout_min: int | None = None
    signal_delay_s: int = 0


# ---- the request against it ---------------------------------------------------------------------------------

def _key(name: str) -> str:
    return f"hydra.launcher.{name}"


# Per node: the key, what the request asks of a node, what the node has, the unit, the key's value that asks for
# `have` (0: nothing), and what a node without any lacks.
_PER_NODE: tuple[tuple[str, Callable[[Request], float], Callable[[Node], int], str, Callable[[int, Request], int],
                       str], ...] = (
    ("gpus_per_node", lambda r: r.gpus_per_node or 0, lambda n: n.gpus, "GPUs", lambda have, r: have, "GPUs"),
    ("cpus_per_task", lambda r: (r.cpus_per_task or 0) * r.tasks_per_node, lambda n: n.cpus, "CPUs",
     lambda have, r: have // r.tasks_per_node, "a CPU"),
    # submitit's --mem=<N>GB: SLURM's G is 1024 MiB
    ("mem_gb", lambda r: (r.mem_gb or 0) * 1024, lambda n: n.memory_mib, "MiB of memory",
     lambda have, r: have // 1024, "1 GiB"),
)


def fitting_nodes(cluster: Cluster, partition: str, req: Request) -> list[Node]:
    return [n for n in cluster.nodes_of(partition) if all(asked(req) <= has(n) for _, asked, has, *_ in _PER_NODE)]


def node_limit(cluster: Cluster, partition: Partition, req: Request) -> int:
    """How many nodes of `partition` one job of `req`'s shape may have."""
    count = len(fitting_nodes(cluster, partition.name, req))
    return count if partition.max_nodes is None else min(count, partition.max_nodes)


def resolve_partition(cluster: Cluster, req: Request) -> Partition:
    """The partition sbatch would use (None: the cluster's default), or a config error with one that works."""
    found = cluster.default() if req.partition is None else cluster.partition(str(req.partition))
    if found is None:
        problem = ("is null (the cluster's default), and this cluster has no default partition"
                   if req.partition is None else f"the cluster has no partition {req.partition!r}")
        raise ConfigError(_key("partition"), problem, _partition_fix(cluster, req))
    if found.state in CLOSED_STATES:
        raise ConfigError(_key("partition"), f"partition {found.name} is {found.state}: it takes no new jobs",
                          _partition_fix(cluster, req, skip=found.name))
    return found


def _partition_fix(cluster: Cluster, req: Request, skip: str | None = None) -> str:
    """A partition that takes the whole request if one does; else the default (or first) open one, whose own
    refusal then says what to change."""
    visible = [p.name for p in cluster.partitions if not p.hidden]
    names = [n for n in (visible or [p.name for p in cluster.partitions]) if n != skip]
    listing = f"(the partitions: {', '.join(names) or 'none'})"
    for name in names:
        try:
            check_request(cluster, replace(req, partition=name))
        except ConfigError:
            continue
        return f"{_key('partition')}={name} {listing}"
    default = cluster.default()
    open_ = [p.name for p in cluster.partitions if p.name in names and p.state not in CLOSED_STATES]
    if default is not None and default.name in open_:
        return f"{_key('partition')}={default.name} {listing}"
    if open_:
        return f"{_key('partition')}={open_[0]} {listing}"
    return f"wait until an administrator opens a partition (`scontrol show partition`) {listing}"


def check_nodes(cluster: Cluster, partition: Partition, req: Request) -> None:
    """GPUs, CPUs and memory per node, then the number of nodes, against `partition`'s nodes."""
    nodes = cluster.nodes_of(partition.name)
    for key, asked, has, unit, value_for, lacking in _PER_NODE:
        most = max((has(n) for n in nodes), default=0)
        if asked(req) <= most:
            continue
        value = getattr(req, key)
        what = f"{key}={'null' if value is None else value}" + (
            f" x tasks_per_node={req.tasks_per_node}" if key == "cpus_per_task" and req.tasks_per_node != 1 else "")
        problem = f"{what} asks each node for {asked(req):g} {unit}; " + (
            f"no node of partition {partition.name} has more than {most}" if most else
            f"no node of partition {partition.name} has any")
        # The fix: the largest value that still leaves the job its nodes; else the most there is, with the nodes
        # having it.
        values = sorted({value_for(has(n), req) for n in nodes} - {0}, reverse=True)
        limits = [node_limit(cluster, partition, replace(req, **{key: v})) for v in values]  # type: ignore[arg-type]
        fix = next((f"{_key(key)}={v}" for v, limit in zip(values, limits, strict=True) if limit >= req.nodes), None)
        if fix is None and values:
            fix = f"{_key(key)}={values[0]}" + (f" {_key('nodes')}={limits[0]}" if limits[0] else "")
        if fix is None:
            fix = f"{_key(key)}=null (no node of {partition.name} has {lacking})"
        else:
            fix += f" ({partition.name}'s nodes: {_shapes(nodes)})"
        raise ConfigError(_key(key), problem, fix)
    check_node_count(cluster, partition, req)


def check_node_count(cluster: Cluster, partition: Partition, req: Request) -> None:
    nodes = cluster.nodes_of(partition.name)
    limit = node_limit(cluster, partition, req)
    if req.nodes <= limit:
        return
    fitting = len(fitting_nodes(cluster, partition.name, req))
    have = f"partition {partition.name} has {len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    if fitting < len(nodes):
        have += f", {fitting} of them with what each node is asked for"
    if partition.max_nodes is not None and partition.max_nodes < fitting:
        have += f", and a job may have {partition.max_nodes} (MaxNodes)"
    if limit == 0:
        raise ConfigError(_key("nodes"), f"nodes={req.nodes}: {have}",
                          f"ask each node for less, or another partition ({partition.name}'s nodes: {_shapes(nodes)})")
    raise ConfigError(_key("nodes"), f"nodes={req.nodes}, and {have}", f"{_key('nodes')}={limit} ({have})")


def _shapes(nodes: list[Node]) -> str:
    shapes: dict[str, int] = {}
    for n in nodes:
        shape = f"{n.gpus} GPUs, {n.cpus} CPUs, {n.memory_mib} MiB"
        shapes[shape] = shapes.get(shape, 0) + 1
    return "; ".join(f"{count} x ({shape})" for shape, count in shapes.items()) or "none"


def check_time_limit(partition: Partition, req: Request) -> None:
    if req.timeout_min is None or partition.max_time_min is None or req.timeout_min <= partition.max_time_min:
        return
    raise ConfigError(_key("timeout_min"), f"{req.timeout_min} minutes is more than partition {partition.name} "
                      f"allows ({partition.max_time_min} minutes, its MaxTime)",
                      f"{_key('timeout_min')}={partition.max_time_min} (partition {partition.name}'s MaxTime)")


def check_request(cluster: Cluster, req: Request) -> Partition:
    """The partition `req` goes to, or the first config error sbatch (or a job pending for good) would meet."""
    partition = resolve_partition(cluster, req)
    check_nodes(cluster, partition, req)
    check_time_limit(partition, req)
    return partition


# ---- the time to the first checkpoint ---------------------------------------------------------------------

@dataclass(frozen=True)
class JobTime:
    """One job of the sweep: what it is (its overrides), the optimizer steps to its first scheduled checkpoint
    (None: none scheduled), whether it saves at SLURM's signal, and a lower bound on seconds per step (None: none
    known)."""
    label: str
    steps_to_first_checkpoint: int | None
    on_signal: bool
    floor_s: float | None


# A job has timeout_min*60 - signal_delay_s seconds (submitit ends it at the signal). With checkpoint.on_signal it
# saves then; else it needs the steps to its first checkpoint at the planner's time floor (a lower bound), with
# start-up taken as 0 s: a limit refused here is certainly too short; one that passes may still be.
def needed_seconds(job: JobTime, signal_delay_s: int) -> float:
    """The least time limit, in seconds, that is not certainly too short for `job`: more than this."""
    work = 0.0
    if not job.on_signal and job.steps_to_first_checkpoint and job.floor_s:
        work = job.steps_to_first_checkpoint * job.floor_s
    return signal_delay_s + work


def check_time_to_checkpoint(partition: Partition, req: Request, jobs: list[JobTime]) -> None:
    if req.timeout_min is None:
        return
    limit_s = req.timeout_min * 60
    short = [(j, needed_seconds(j, req.signal_delay_s)) for j in jobs]
    short = [(j, need) for j, need in short if limit_s <= need]
    if not short:
        return
    job, need = max(short, key=lambda jn: jn[1])
    enough = math.floor(need / 60) + 1
    work = need - req.signal_delay_s
    label = f" (job {job.label})" if job.label else ""
    if work <= 0:
        problem = (f"{req.timeout_min} min{label}: SLURM signals the job signal_delay_s={req.signal_delay_s} s before "
                   f"its limit, and submitit ends it there, so it would end before doing anything")
    else:
        problem = (f"{req.timeout_min} min{label}: its first checkpoint is {job.steps_to_first_checkpoint} steps in, "
                   f"at least {job.floor_s:.3g} s each ({work:,.0f} s), and submitit ends the job at SLURM's signal, "
                   f"signal_delay_s={req.signal_delay_s} s before the limit")
    most = partition.max_time_min
    if most is None or enough <= most:
        fix = (f"{_key('timeout_min')}={enough} (the least that is not certainly too short: allow more for start-up "
               f"and saving)")
    else:  # the partition allows less: save at the signal instead, a signal that comes within the limit
        delay = req.signal_delay_s if most * 60 > req.signal_delay_s else most * 60 // 2
        fix = (f"{_key('timeout_min')}={most}" + (f" {_key('signal_delay_s')}={delay}" if delay != req.signal_delay_s
                                                  else "")
               + f" checkpoint.on_signal=true (partition {partition.name} allows at most {most} min: save at "
               f"SLURM's signal)")
    raise ConfigError(_key("timeout_min"), problem, fix)

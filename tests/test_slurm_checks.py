"""hydra/launcher=slurm: the request is checked against the cluster before anything is submitted
(job/slurm_cluster.py, job/slurm_cluster.py, cli/callbacks.py, cli/callbacks.py). Parsing on scontrol's real output, the checks on a described
cluster, and each refusal through the real CLI against the local two-node cluster (nothing submitted)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_module
from omegaconf import open_dict

import zerotune.config.compose  # noqa: F401 (registers the schema config.yaml names)
from tests.helpers.cli import run_cli
from zerotune.cli import callbacks
from zerotune.cli.callbacks import check_slurm_sweep, sweep_jobs
from zerotune.config import search
from zerotune.config.compose.settle import settle
from zerotune.config.errors import ConfigError
from zerotune.job.slurm_cluster import (
    Cluster,
    JobTime,
    Node,
    Partition,
    Request,
    check_request,
    check_time_to_checkpoint,
    parse_gres,
    parse_nodes,
    parse_partitions,
    parse_records,
    parse_time_min,
)

# `scontrol --all show partition -o` and `scontrol show node -o` on scripts/slurm_local.sh's cluster (slurm-wlm 22.05).
PARTITION_OUT = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED "
    "MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=zt-node[1-2] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO "
    "ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=4 TotalNodes=2 "
    "SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=4,mem=24104M,node=2,billing=4\n")
NODE_OUT = "".join(
    f"NodeName=zt-node{i} Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.44 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 "
    f"NodeHostName=zt-node{i} Port=1681{7 + i} Version=22.05.8 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  "
    "RealMemory=12052 AllocMem=0 FreeMem=21364 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 "
    "Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2026-11-25T15:53:47 SlurmdStartTime=2026-11-25T20:09:19 "
    "LastBusyTime=2026-11-25T20:27:51 CfgTRES=cpu=2,mem=12052M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 "
    "AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n" for i in (1, 2))


def test_parse_real_scontrol_output():
    (debug,) = parse_partitions(PARTITION_OUT)
    assert debug == Partition("debug", True, "UP", None, None, False)
    nodes = parse_nodes(NODE_OUT)
    assert [n.name for n in nodes] == ["zt-node1", "zt-node2"]
    assert nodes[0] == Node("zt-node1", ("debug",), 2, 12052, 0, ())
    record = parse_records(NODE_OUT)[0]  # values with spaces, with '=', and empty ones
    assert record["OS"] == "Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0"
    assert record["CfgTRES"] == "cpu=2,mem=12052M,billing=2" and record["AllocTRES"] == ""


@pytest.mark.parametrize("gres, expected", [
    ("(null)", (0, ())), ("gpu:4", (4, ())), ("gpu:a100:4(S:0-1)", (4, ("a100",))),
    ("gpu:a100:2(S:0,1),gpu:v100:2,shard:8", (4, ("a100", "v100"))), ("gpu:nvidia_h100_80gb_hbm3:8", (8, ("nvidia_h100_80gb_hbm3",))),
])
def test_parse_gres(gres, expected):
    assert parse_gres(gres) == expected


@pytest.mark.parametrize("text, minutes", [
    ("UNLIMITED", None), ("INFINITE", None), ("30", 30), ("30:00", 30), ("01:30", 1), ("04:00:00", 240),
    ("2-00:00:00", 2880), ("1-12", 2160), ("1-01:30", 1530),
])
def test_parse_time(text, minutes):
    assert parse_time_min(text) == minutes


# A described cluster: a GPU partition of mixed nodes (the default), a CPU one, a drained one.
CLUSTER = Cluster(
    (Partition("gpu", True, "UP", 2880, None), Partition("cpu", False, "UP", None, 2), Partition("old", False, "DRAIN", None, None)),
    (Node("a1", ("gpu",), 32, 256_000, 4, ("a100",)), Node("a2", ("gpu",), 32, 256_000, 4, ("a100",)),
     Node("h1", ("gpu", "old"), 64, 1_000_000, 8, ("h100",)),
     Node("c1", ("cpu",), 16, 64_000, 0), Node("c2", ("cpu",), 16, 64_000, 0), Node("c3", ("cpu",), 16, 64_000, 0)))

_FIELDS = {f"hydra.launcher.{k}" for k in Request.__dataclass_fields__}


def applied(req: Request, fix: str) -> Request:
    """`req` with the hydra.launcher.* overrides of a fix applied."""
    for key, value in re.findall(r"(hydra\.launcher\.\w+)=(\S+)", fix.split(" (")[0]):
        assert key in _FIELDS, fix
        typed = None if value == "null" else value if key.endswith("partition") else int(value)
        req = replace(req, **{key.rsplit(".", 1)[1]: typed})
    return req


@pytest.mark.parametrize("req, key, fix", [
    (Request(partition="gpus"), "partition", "hydra.launcher.partition=gpu (the partitions: gpu, cpu, old)"),
    (Request(partition="old"), "partition", "hydra.launcher.partition=gpu"),
    (Request(nodes=2, gpus_per_node=8), "nodes", "hydra.launcher.nodes=1 (partition gpu has 3 nodes, 1 of them"),
    (Request(nodes=2, gpus_per_node=16), "gpus_per_node", "hydra.launcher.gpus_per_node=4 ("),
    (Request(nodes=3, gpus_per_node=16), "gpus_per_node", "hydra.launcher.gpus_per_node=4 ("),
    (Request(nodes=2, gpus_per_node=16, cpus_per_task=64), "gpus_per_node",
     "hydra.launcher.gpus_per_node=8 hydra.launcher.nodes=1 ("),
    (Request(partition="cpu", gpus_per_node=1), "gpus_per_node", "hydra.launcher.gpus_per_node=null (no node of cpu has GPUs)"),
    (Request(partition="cpu", nodes=3), "nodes", "hydra.launcher.nodes=2 (partition cpu has 3 nodes, and a job may have 2"),
    (Request(partition="cpu", cpus_per_task=12, tasks_per_node=2), "cpus_per_task", "hydra.launcher.cpus_per_task=8 ("),
    (Request(gpus_per_node=4, mem_gb=2000, nodes=2), "mem_gb", "hydra.launcher.mem_gb=250 ("),
    (Request(timeout_min=4000), "timeout_min", "hydra.launcher.timeout_min=2880 (partition gpu's MaxTime)"),
])
def test_refusal_and_its_fix(req, key, fix):
    with pytest.raises(ConfigError) as refused:
        check_request(CLUSTER, req)
    assert refused.value.key == f"hydra.launcher.{key}"
    assert refused.value.fix.startswith(fix), refused.value.fix
    check_request(CLUSTER, applied(req, refused.value.fix))


def test_no_default_partition():
    cluster = replace(CLUSTER, partitions=tuple(replace(p, default=False) for p in CLUSTER.partitions))
    with pytest.raises(ConfigError, match="no default partition") as refused:
        check_request(cluster, Request())
    assert refused.value.fix.startswith("hydra.launcher.partition=gpu")


GPU = CLUSTER.partition("gpu")


def test_time_to_first_checkpoint():
    req = Request(gpus_per_node=8, timeout_min=60, signal_delay_s=120)
    fast, slow = JobTime("a", 1000, False, 0.5), JobTime("b", 10_000, False, 0.5)
    check_time_to_checkpoint(GPU, req, [fast, JobTime("c", None, False, None)])  # 120 + 500 s < 60 min
    with pytest.raises(ConfigError) as refused:  # 120 + 5000 s: certainly more than 60 min
        check_time_to_checkpoint(GPU, req, [fast, slow])
    assert refused.value.key == "hydra.launcher.timeout_min" and "(job b)" in refused.value.problem
    assert refused.value.fix.startswith("hydra.launcher.timeout_min=86 ")
    check_time_to_checkpoint(GPU, applied(req, refused.value.fix), [fast, slow])
    check_time_to_checkpoint(GPU, req, [replace(slow, on_signal=True)])  # it saves at the signal
    check_time_to_checkpoint(GPU, req, [replace(slow, floor_s=None)])  # no floor: nothing certain


def test_a_limit_within_the_signal_delay():
    req = Request(timeout_min=2, signal_delay_s=120)
    for job in (JobTime("", None, False, None), JobTime("", 10, True, 1.0)):
        with pytest.raises(ConfigError, match="before doing anything") as refused:
            check_time_to_checkpoint(GPU, req, [job])
        assert refused.value.fix.startswith("hydra.launcher.timeout_min=3 ")


def test_time_fix_within_the_partitions_limit():
    short = replace(GPU, max_time_min=60)
    with pytest.raises(ConfigError) as refused:
        check_time_to_checkpoint(short, Request(timeout_min=30, signal_delay_s=120), [JobTime("b", 10_000, False, 0.5)])
    assert refused.value.fix.startswith("hydra.launcher.timeout_min=60 checkpoint.on_signal=true ")


def test_gres_card():
    nodes = {n.name: n for n in CLUSTER.nodes}
    assert callbacks.gres_card([nodes["a1"], nodes["h1"]]).name == "h100"  # the fastest: a lower bound for all
    assert callbacks.gres_card([replace(nodes["a1"], gpu_types=("nvidia_h100_80gb_hbm3",))]).name == "h100"
    assert callbacks.gres_card([replace(nodes["a1"], gpu_types=("l40",))]) is None  # not an l4
    assert callbacks.gres_card([replace(nodes["a1"], gpu_types=())]) is None


def _sweep_config(overrides: list[str], task_line: list[str] | None = None):
    """The sweep's config as Hydra gives it to on_multirun_start (`task_line`: the task overrides as typed, with
    their sweeps; Hydra's compose API takes none)."""
    cfg = compose("config", overrides=overrides, return_hydra_config=True)
    if task_line is not None:
        with open_dict(cfg):
            cfg.hydra.overrides.task = task_line
    return cfg


def test_the_planners_floor_per_job():
    """With GPUs of a known card, each job of the sweep is composed as Hydra's launcher would, and planned."""
    cluster = Cluster((Partition("gpu", True, "UP", 2880, None),),
                      tuple(Node(f"g{i}", ("gpu",), 64, 512_000, 8, ("h100",)) for i in range(2)))
    task = ["precision=bf16", "train.max_steps=1000000000", "train.batch_size=64"]
    with initialize_config_module(search.PACKAGED_CONF, version_base="1.3"):
        cfg = _sweep_config(["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.timeout_min=10",
                             *task, "zero_stage='1'"], [*task, "zero_stage='1','2'", "checkpoint.on_signal=false,true"])
        req = callbacks.request_of(cfg.hydra.launcher)
        settle_job = lambda o: settle(compose("config", overrides=o), o)  # noqa: E731
        jobs = callbacks.job_times(sweep_jobs(cfg), settle_job, cluster, check_request(cluster, req), req)
    assert [j.label.split()[-2:] for j in jobs] == [["zero_stage='1'", "checkpoint.on_signal=False"],
                                                    ["zero_stage='1'", "checkpoint.on_signal=True"],
                                                    ["zero_stage='2'", "checkpoint.on_signal=False"],
                                                    ["zero_stage='2'", "checkpoint.on_signal=True"]]
    assert [j.on_signal for j in jobs] == [False, True, False, True]
    assert all(j.steps_to_first_checkpoint == 10**9 for j in jobs)
    floors = [j.floor_s for j in jobs if not j.on_signal]
    assert all(f and f > 0 for f in floors) and all(j.floor_s is None for j in jobs if j.on_signal)
    with pytest.raises(ConfigError, match="first checkpoint is 1000000000 steps in") as refused:
        check_time_to_checkpoint(cluster.partitions[0], req, jobs)
    assert refused.value.key == "hydra.launcher.timeout_min"


# ---- through the real CLI, against the local cluster ---------------------------------------------------------

BASE = {"hydra/launcher": "slurm", "hydra.launcher.nodes": "2", "hydra.launcher.gpus_per_node": "null",
        "hydra.launcher.cpus_per_task": "1", "hydra.launcher.timeout_min": "10", "train.max_steps": "2",
        "data": "synthetic", "model": "tiny", "resolution": "8", "train.batch_size": "8"}


def _node(slurm_cluster) -> Node:
    return parse_nodes(slurm_cluster.run("scontrol", "show", "node", "-o").stdout)[0]


@pytest.mark.parametrize("bad, key, fix", [
    ({"hydra.launcher.partition": "gpu"}, "partition", "hydra.launcher.partition=debug (the partitions: debug)"),
    ({"hydra.launcher.nodes": "3"}, "nodes", "hydra.launcher.nodes=2 (partition debug has 2 nodes)"),
    ({"hydra.launcher.gpus_per_node": "8"}, "gpus_per_node", "hydra.launcher.gpus_per_node=null (no node of debug has GPUs)"),
    ({"hydra.launcher.cpus_per_task": "{cpus+1}"}, "cpus_per_task", "hydra.launcher.cpus_per_task={cpus} ("),
    ({"hydra.launcher.mem_gb": "100000"}, "mem_gb", "hydra.launcher.mem_gb={gib} ("),
    ({"hydra.launcher.timeout_min": "2"}, "timeout_min", "hydra.launcher.timeout_min=3 ("),
])
def test_refused_before_submission(slurm_cluster, tmp_path, bad, key, fix):
    node = _node(slurm_cluster)
    sizes = {"cpus+1": node.cpus + 1, "cpus": node.cpus, "gib": node.memory_mib // 1024}
    bad = {k: v.format(**sizes) for k, v in bad.items()}
    fix = fix.format(**sizes)
    overrides = {**BASE, **bad}
    done = run_cli("-m", *(f"{k}={v}" for k, v in overrides.items()), "zero_stage=1,2", cwd=tmp_path,
                   env=slurm_cluster.env(), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"zerotune: config error at `hydra.launcher.{key}`" in done.stderr, done.stderr
    assert f"  fix: {fix}" in done.stderr, done.stderr
    assert slurm_cluster.run("squeue", "-h").stdout.strip() == ""  # nothing submitted
    assert not (tmp_path / "multirun").exists()  # nothing written
    # The fix, applied, passes the same check against the same cluster.
    fixed = dict(re.findall(r"(hydra\.launcher\.\w+)=(\S+)", done.stderr.split("  fix: ")[1].split(" (")[0]))
    with initialize_config_module(search.PACKAGED_CONF, version_base="1.3"):
        cfg = _sweep_config([f"{k}={v}" for k, v in {**overrides, **fixed}.items() if k.startswith("hydra")])
    assert check_slurm_sweep(cfg, env=slurm_cluster.env()).name == "debug"


def test_no_cluster_here(tmp_path):
    missing = tmp_path / "slurm.conf"
    done = run_cli("-m", "hydra/launcher=slurm", "zero_stage=1,2", cwd=tmp_path, env={"SLURM_CONF": str(missing)},
                   timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"config error at `hydra/launcher`: hydra/launcher=slurm submits to a SLURM cluster, and SLURM_CONF={missing} " \
           "is not a file" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "multirun").exists()


def test_other_launchers_are_not_checked():
    assert not callbacks.is_slurm({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"})
    assert callbacks.is_slurm({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"})


def test_counts_below_one():
    with pytest.raises(ConfigError, match="must be at least 1, got 0") as refused:
        callbacks.request_of({"nodes": 0})
    assert refused.value.key == "hydra.launcher.nodes" and refused.value.fix == "hydra.launcher.nodes=1"

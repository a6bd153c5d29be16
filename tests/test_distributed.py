"""Several processes per job: zerotune's own launch, external launchers, nodes, SLURM, ZeRO partitioning.

Everything runs on the CPU with gloo. The end-to-end tests are few and short (2 steps, batch 4 per
process): on 2 cores each 2-process run costs 30-50 s, mostly start-up.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.cli import ROOT, cli_env, compose_cfg, read_losses, read_summary, run_cli
from zerotune.train.distributed import free_port

QUICK = ["train.max_steps=2", "train.log_every=1", "evaluate.enabled=false", "scheduler=constant"]

# ---------------------------------------------------------------------------------------------- helpers


def rank_losses(summary: dict) -> list[list[float]]:
    """[[rank 0's loss per step], [rank 1's], ...] from the ranks' records rank 0 gathered."""
    ranks = summary["memory"]["per_rank"]
    return [[r["losses"][k] for k in sorted(r["losses"], key=int)] for r in ranks]


@functools.cache
def partition_tolerance_bytes(world: int) -> int:
    """How far a rank's share may sit above `whole / world`: DeepSpeed pads partitions for alignment.

    Stages 1-2 pad each flat parameter group to a multiple of (2 × world) elements; stage 3 pads each
    parameter tensor to a multiple of the world size. So at most (2 × world) fp32 elements per tensor
    and per group: 4 bytes × 2 × world × (tensors + groups). For the tiny U-Net (95 tensors) that is
    under 1 KB of ~4.4 MB, 0.02 %; a rank that kept the whole state would be 2.2 MB off.
    """
    from zerotune.models import build_network

    tensors = len(list(build_network(compose_cfg().model).parameters()))
    return 4 * 2 * world * (tensors + 4)


def assert_partitioned(p1: dict, p2: dict, stage: int) -> None:
    """World 2 vs world 1: what ZeRO `stage` partitions halves (within padding); the rest stays whole."""
    assert p1["world_size"] == 1 and p2["world_size"] == 2 and p1["zero_stage"] == p2["zero_stage"] == stage
    tol = partition_tolerance_bytes(2)
    partitioned = {"master_weights_bytes": stage >= 1, "optimizer_state_bytes": stage >= 1,
                   "grads_bytes": stage >= 2, "params_bytes": stage >= 3}
    for key, halves in partitioned.items():
        assert p1[key] > 1_000_000, (key, p1)  # the real figure, not a placeholder
        if halves:
            assert p1[key] / 2 <= p2[key] <= p1[key] / 2 + tol, (key, stage, p1[key], p2[key])
        else:
            assert p2[key] == p1[key], (key, stage, p1[key], p2[key])


def no_process_left(marker: str) -> None:
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                left.append(proc.pid)
        except psutil.Error:
            pass
    assert not left, f"processes still running for {marker}: {left}"


def launcher_env() -> dict:
    env = cli_env()
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def only_run_dir(cwd: Path) -> Path:
    """Every rank must have used ONE run directory: exactly one under outputs/<date>/."""
    dirs = [d for d in (cwd / "outputs").glob("*/*") if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


# ---------------------------------------------------------------------------------------------- fast


@pytest.mark.parametrize(("nodelist", "first"), [("gpu01", "gpu01"), ("gpu[07-08],login1", "gpu07"),
                                                ("n[098-101]", "n098"), ("rack[1-2]-n[1-2]", "rack1-n1")])
def test_slurm_master_is_the_first_host_of_the_node_list(nodelist, first, monkeypatch):
    from zerotune.job.slurm import launch_from_slurm

    for key, value in {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "2",
                       "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    assert launch_from_slurm({"master_port": "auto"})["master_addr"] == first


def test_slurm_env_maps_to_the_launch_block(monkeypatch):
    from zerotune.job.slurm import PORT_BASE, PORT_SPAN, in_slurm_job, launch_from_slurm

    env = {"SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4", "SUBMITIT_EXECUTOR": "slurm"}
    launch = {"num_processes": 1, "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1",
              "master_port": "auto", "rdzv_timeout_s": 900, "slurm": "auto"}
    assert in_slurm_job(env) and not in_slurm_job(env, "false")
    assert not in_slurm_job({k: v for k, v in env.items() if k != "SUBMITIT_EXECUTOR"})  # a bare salloc shell
    assert in_slurm_job({k: v for k, v in env.items() if k != "SUBMITIT_EXECUTOR"}, "true")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = launch_from_slurm(launch)
    assert out["nnodes"] == 2 and out["node_rank"] == 1 and out["master_addr"] == "gpu07"
    assert out["num_processes"] == 4
    assert out["master_port"] == PORT_BASE + 123456 % PORT_SPAN  # every node derives the same port
    assert out["run_id"] == "slurm-123456"
    # A port given by the user wins; "gpu:a100:8" is read as 8 GPUs.
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "")
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "gpu:a100:8")
    out = launch_from_slurm({**launch, "master_port": 29500})
    assert out["master_port"] == 29500 and out["num_processes"] == 8


def test_slurm_launcher_composes_and_submits_the_right_sbatch(tmp_path):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from tests.helpers.slurm import sbatch_script, submission
    with initialize_config_module("zerotune.config.conf", version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=4",
                                 "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=90"])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.zerotune_slurm.SlurmLauncher"  # the plugin's, waiting through squeue
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 4, 1)
    assert launcher.partition == "gpu" and launcher.timeout_min == 90
    block = OmegaConf.to_container(launcher, resolve=False)
    block.update(submitit_folder=str(tmp_path / "%j"), name="train")
    init, params = submission(block)
    assert init["folder"] == str(tmp_path / "%j")
    assert params["nodes"] == 2 and params["slurm_partition"] == "gpu" and params["gpus_per_node"] == 4
    script = sbatch_script(block, str(tmp_path / "%j"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --partition=gpu", "#SBATCH --time=90", "#SBATCH --cpus-per-task=32",
                 "export SUBMITIT_EXECUTOR=slurm"):
        assert line in script, script
    assert "--kill-on-bad-exit=1" in next(line for line in script.splitlines() if line.startswith("srun ")), script


def test_launch_block_is_checked():
    from zerotune.config.errors import ConfigError
    from zerotune.job.elastic import check_launch, launch_config

    cfg = compose_cfg("launch.nnodes=2")
    with pytest.raises(ConfigError, match="one port they all know"):
        check_launch(cfg.launch)
    with pytest.raises(ConfigError, match="outside 0..1"):
        check_launch(compose_cfg("launch.nnodes=2", "launch.node_rank=2", "launch.master_port=29500").launch)
    # The nodes of one job share the rendezvous run id and keep one log folder each.
    one = launch_config(compose_cfg("launch.nnodes=2", "launch.master_port=29500").launch, Path("/r"))
    two = launch_config(compose_cfg("launch.nnodes=2", "launch.master_port=29500", "launch.node_rank=1").launch,
                        Path("/r"))
    assert one.run_id == two.run_id
    assert one.logs_specs.root_log_dir != two.logs_specs.root_log_dir


def test_global_batch_draws_slice_the_same_samples():
    """Rank r of N draws exactly rows [r·B, (r+1)·B) of what one process with batch N·B draws."""
    from zerotune.train.distributed import global_batch_draws

    def draws(world, rank, batch):
        gen = torch.Generator().manual_seed(11)
        return [global_batch_draws(gen, (batch, 1, 16, 16), rank, world, 1000, 0.1) for _ in range(2)]

    whole = draws(1, 0, 8)
    halves = [draws(2, r, 4) for r in range(2)]
    for step in range(2):
        for key in ("uniform", "noise", "timesteps"):
            joined = torch.cat([halves[r][step][key] for r in range(2)])
            assert torch.equal(joined, whole[step][key]), key
    # One process draws what it always drew (rand, randn, randint from one generator): runs reproduce.
    gen = torch.Generator().manual_seed(11)
    u, n, t = torch.rand(8, generator=gen), torch.randn(8, 1, 16, 16, generator=gen), torch.randint(
        0, 1000, (8,), generator=gen)
    assert torch.equal(whole[0]["uniform"], u) and torch.equal(whole[0]["noise"], n)
    assert torch.equal(whole[0]["timesteps"], t)


def test_pinned_clock_gives_every_rank_one_run_dir():
    from datetime import datetime

    import hydra.core.utils as hydra_utils

    from zerotune.cli.train import pin_hydra_clock

    saved = hydra_utils.datetime
    try:
        pin_hydra_clock(datetime(2030, 1, 2, 3, 4, 5, 678901))
        hydra_utils.setup_globals()
        from omegaconf import OmegaConf

        dirs = {OmegaConf.create({"d": "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S-%f}"}).d for _ in range(3)}
        assert dirs == {"outputs/2030-01-02/03-04-05-678901"}
    finally:
        hydra_utils.datetime = saved
        hydra_utils.setup_globals()


def test_root_cause_of_a_failed_rank_leads_the_error(tmp_path):
    from zerotune.job.elastic import LaunchResult
    from zerotune.job.records import merge_job_view
    from zerotune.rundir.summary import RunSummary

    (tmp_path / "logs" / "x" / "attempt_0" / "1").mkdir(parents=True)
    (tmp_path / "logs" / "x" / "attempt_0" / "1" / "stderr.log").write_text("boom on rank 1\n")
    summary = RunSummary.from_json({"status": "failed",
                                    "error": {"type": "DistBackendError", "message": "Connection closed by peer"}})
    peaks = {"host_peak_rss_mib": 10.0, "nvme_peak_mib": None, "gpu_peak_process_mib": None,
             "gpu_peak_device_mib": None}
    result = LaunchResult("failed", "rank 1 exited with code 1: RuntimeError: x", failed_rank=1, failed_local_rank=1)
    out = merge_job_view(summary, result, peaks, tmp_path)
    assert out.error["failed_rank"] == 1 and out.error["message"].startswith("rank 1 exited")
    assert out.error["rank0_error"]["message"] == "Connection closed by peer"
    assert out.error["log_tail"] == ["boom on rank 1"]


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def zero2_pair(tmp_path_factory):
    """Stage 2, the same global batch of 8: 2 processes × 4, and 1 process × 8."""
    base = tmp_path_factory.mktemp("zero2")
    runs = {}
    for world, batch in ((2, 4), (1, 8)):
        run = base / f"w{world}"
        proc = run_cli(*QUICK, "zero_stage=2", f"launch.num_processes={world}", f"train.batch_size={batch}",
                       f"hydra.run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[world] = read_summary(run)
        runs[world]["_dir"] = run
    return runs


@pytest.mark.slow
def test_two_processes_compute_what_one_computes_with_twice_the_batch(zero2_pair):
    """fp32: 2 × B and 1 × 2B see the same samples with the same noise, so the global loss per step agrees.

    Tolerance 1e-5 relative: the only differences left are fp32 summation orders (convolutions over 4
    vs 8 samples, the mean over two means, gloo's all-reduce of the two ranks' gradients), ~1e-7 per
    operation, compounded over 2 AdamW steps. Different data or noise would differ by >1e-2.
    """
    one, two = zero2_pair[1], zero2_pair[2]
    assert one["status"] == two["status"] == "ok" and two["choices"]["world_size"] == 2
    w1 = read_losses(one["_dir"])
    per_rank = rank_losses(two)
    assert len(per_rank) == 2 and per_rank[0] != per_rank[1]  # the ranks trained on different samples
    w2 = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    assert len(w1) == len(w2) == 2
    assert w2 == pytest.approx(w1, rel=1e-5, abs=0), (w1, w2)
    # Memory: the job reports every rank and the largest.
    mem = two["memory"]
    assert [r["rank"] for r in mem["per_rank"]] == [0, 1]
    assert mem["host_peak_rss_mib_max_rank"] == max(r["host_peak_rss_mib"] for r in mem["per_rank"]) > 50
    assert mem["gpu_peak_process_mib_max_rank"] is None  # no GPU: unmeasured, not 0
    # Threads: the cores shared by the node's workers (launch.threads=auto), unless OMP_NUM_THREADS says
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0))
        assert one["threads"]["intra_op"] == cores and two["threads"]["intra_op"] == max(1, cores // 2)


@pytest.mark.slow
def test_zero2_partitions_grads_master_weights_and_optimizer_states(zero2_pair):
    one, two = zero2_pair[1], zero2_pair[2]
    assert_partitioned(one["partition"], two["partition"], stage=2)
    r0, r1 = (r["partition"] for r in two["memory"]["per_rank"])
    assert r0["master_weights_bytes"] + r1["master_weights_bytes"] >= one["partition"]["master_weights_bytes"]


@pytest.mark.slow
def test_sweep_over_num_processes_and_zero3_partitions_parameters(tmp_path):
    """`-m launch.num_processes=1,2` at stage 3 (no persistent small parameters, so all are partitioned)."""
    proc = run_cli("-m", *QUICK, "zero_stage=3", "train.batch_size=4", "launch.num_processes=1,2",
                   "deepspeed.stage3_param_persistence_threshold=0", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = read_summary(tmp_path / "0"), read_summary(tmp_path / "1")
    assert one["status"] == two["status"] == "ok", (one.get("error"), two.get("error"))
    assert one["choices"]["world_size"] == 1 and two["choices"]["world_size"] == 2
    assert_partitioned(one["partition"], two["partition"], stage=3)


@pytest.mark.slow
def test_a_dying_rank_takes_the_job_down_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *QUICK, "train.max_steps=4",
                             "train.batch_size=4", "launch.num_processes=2", "debug.fail_at_step=2",
                             "debug.fail_rank=1", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)  # bounded: a hung peer would blow this
    assert proc.returncode == 1, out[-3000:]
    summary = read_summary(tmp_path)
    assert summary["status"] == "failed"
    assert summary["error"]["failed_rank"] == 1
    assert "rank 1 exited with code 1" in summary["error"]["message"]
    assert "debug.fail_at_step=2: injected failure" in summary["error"]["message"]
    assert any("injected failure" in line for line in summary["error"]["log_tail"])
    assert len(read_losses(tmp_path)) == 2  # rank 0 logged steps 1 and 2 (rank 1 failed before its step 3)
    no_process_left(str(tmp_path))


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    """launch.nnodes=2: both node processes started here, one worker each, one shared run directory."""
    port = free_port()
    args = [*QUICK, "train.batch_size=4", "launch.nnodes=2", "launch.master_addr=127.0.0.1",
            f"launch.master_port={port}", f"hydra.run.dir={tmp_path}"]
    nodes = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"launch.node_rank={k}"], cwd=ROOT,
                              env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in (0, 1)]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    summary = read_summary(tmp_path)
    assert summary["status"] == "ok" and summary["choices"]["world_size"] == 2
    assert [r["rank"] for r in summary["memory"]["per_rank"]] == [0, 1]  # rank 1 ran under node 1's agent
    node1 = json.loads((tmp_path / "summary.node1.json").read_text())
    assert node1["status"] == "ok" and node1["node_rank"] == 1
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["node0", "node1"]


def _external(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=launcher_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "deepspeed"])
def test_external_launchers_share_one_run_dir(launcher, tmp_path):
    port = str(free_port())
    bindir = Path(sys.executable).parent
    cmd = {"torchrun": [str(bindir / "torchrun"), "--nproc_per_node", "2", "--master_port", port],
           # On a CPU, --multi_gpu is what starts N processes (through torchrun); without it accelerate
           # runs ONE process (its multi-CPU path needs mpirun).
           "accelerate": [str(bindir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                          "--main_process_port", port],
           "deepspeed": [str(bindir / "deepspeed"), "--num_gpus", "2", "--master_port", port]}[launcher]
    proc = _external([*cmd, str(ROOT / "train.py"), *QUICK, "zero_stage=1", "train.batch_size=4"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = only_run_dir(tmp_path)
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["choices"]["world_size"] == 2
    assert [r["rank"] for r in summary["memory"]["per_rank"]] == [0, 1]
    assert summary["memory"]["host_peak_rss_mib_max_rank"] > 50
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["rank0.json", "rank1.json"]
    # ZeRO-1 across the launcher's 2 ranks: each holds half the master weights and optimizer states.
    p = summary["partition"]
    assert p["world_size"] == 2 and p["zero_stage"] == 1
    assert p["grads_bytes"] == p["params_bytes"]  # stage 1 keeps whole gradients
    assert p["params_bytes"] / 2 <= p["master_weights_bytes"] <= p["params_bytes"] / 2 + partition_tolerance_bytes(2)
    assert len(read_losses(run)) == 2


def test_launch_config_fits_an_older_torch(monkeypatch):
    """torch 2.11 (the CUDA images') has no LaunchConfig.shutdown_timeout: the launch still builds, without it."""
    import dataclasses

    import torch.distributed.launcher.api as api

    from zerotune.job.elastic import launch_config

    fields = [(f.name, f.type, f) for f in dataclasses.fields(api.LaunchConfig) if f.name != "shutdown_timeout"]
    older = dataclasses.make_dataclass("LaunchConfig", fields)
    monkeypatch.setattr(api, "LaunchConfig", older)
    built = launch_config(compose_cfg().launch, Path("/r"))
    assert isinstance(built, older) and not hasattr(built, "shutdown_timeout")
    assert built.signals_to_handle and built.nproc_per_node == 1
    monkeypatch.undo()
    assert launch_config(compose_cfg("launch.stop_grace_s=7").launch, Path("/r")).shutdown_timeout == 7

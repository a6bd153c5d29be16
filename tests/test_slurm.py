"""zerotune's SLURM path on a real cluster: two nodes on this machine (scripts/slurm_local.sh, the
`slurm_cluster` fixture), jobs submitted as a user submits them. The quick single-node job runs in the default
suite; the two-node runs are slow."""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import pytest

from tests.helpers.cli import read_losses, read_summary, run_cli

NODES = {"zt-node1", "zt-node2"}
# A tiny job: the tiny U-Net on synthetic 8 px data, two steps, no sampling.
SHORT = ["data=synthetic", "model=tiny", "resolution=8", "train.batch_size=8", "train.max_steps=2",
         "evaluate.enabled=false"]
# hydra/launcher=slurm as this cluster needs it: CPU nodes (no GPUs), one CPU per node's task.
ON_CLUSTER = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
              "hydra.launcher.timeout_min=10"]


def sweep_jobs(cwd: Path) -> list[Path]:
    (sweep,) = [Path(p) for p in glob.glob(str(cwd / "multirun" / "*" / "*"))]
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def nothing_queued(cluster) -> bool:
    for _ in range(20):  # a finished job leaves the queue within a few seconds
        if not cluster.run("squeue", "-h").stdout.strip():
            return True
        time.sleep(0.5)
    return False


def test_a_job_submitted_to_the_cluster_trains_and_records_its_slurm_job(slurm_cluster, tmp_path):
    started = time.monotonic()
    proc = run_cli("-m", *ON_CLUSTER, "hydra.launcher.nodes=1", *SHORT, cwd=tmp_path, env=slurm_cluster.env(),
                   timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job,) = sweep_jobs(tmp_path)
    summary = read_summary(job)
    assert summary["status"] == "ok" and summary["steps"] == 2
    slurm = summary["slurm"]
    assert slurm["job_id"].isdigit() and slurm["partition"] == "debug" and slurm["num_nodes"] == 1
    assert slurm["restart_count"] == 0
    shown = slurm["array_job"] or slurm["job_id"]  # submitit submits one job alone, several as an array
    (rank,) = summary["memory"]["per_rank"]
    assert rank["node"] in NODES and rank["node_rank"] == 0
    report = (job.parent / "summary.md").read_text()
    assert "| SLURM job |" in report and f"| {shown} |" in report
    assert nothing_queued(slurm_cluster)
    print(f"single-node SLURM job: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_a_two_job_sweep_trains_each_job_on_both_nodes(slurm_cluster, tmp_path):
    started = time.monotonic()
    proc = run_cli("-m", *ON_CLUSTER, "hydra.launcher.nodes=2", "zero_stage=1,2", *SHORT, cwd=tmp_path,
                   env=slurm_cluster.env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sweep_jobs(tmp_path)
    assert len(jobs) == 2
    for job in jobs:
        summary = read_summary(job)
        assert summary["status"] == "ok", summary.get("error")
        assert summary["slurm"]["num_nodes"] == 2 and summary["slurm"]["nodelist"] == "zt-node[1-2]"
        ranks = summary["memory"]["per_rank"]
        assert {r["node"] for r in ranks} == NODES and sorted(r["node_rank"] for r in ranks) == [0, 1]
        assert (job / "summary.node1.json").is_file() and not (job / "attempts").exists()
    assert nothing_queued(slurm_cluster)
    print(f"two-job sweep on two nodes: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_two_nodes_of_one_process_compute_what_one_node_of_two_does(slurm_cluster, tmp_path):
    """Same global batch (2 ranks x 8): the only differences left are fp32 summation orders (see
    test_distributed's tolerance), not data or noise."""
    started = time.monotonic()
    on_nodes = run_cli("-m", *ON_CLUSTER, "hydra.launcher.nodes=2", "zero_stage=2", *SHORT, cwd=tmp_path,
                       env=slurm_cluster.env(), timeout=900)
    assert on_nodes.returncode == 0, on_nodes.stderr[-3000:]
    one_node = tmp_path / "one_node"
    local = run_cli("zero_stage=2", "launch.num_processes=2", *SHORT, f"hydra.run.dir={one_node}", cwd=tmp_path,
                    timeout=900)
    assert local.returncode == 0, local.stderr[-3000:]
    (job,) = sweep_jobs(tmp_path)
    two_nodes, one = read_losses(job), read_losses(one_node)
    assert len(two_nodes) == len(one) == 2
    assert two_nodes == pytest.approx(one, rel=1e-5, abs=0), (two_nodes, one)
    print(f"2 nodes x 1 vs 1 node x 2: losses {two_nodes} / {one}, {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_an_sbatch_script_that_sruns_train_py_trains_on_both_nodes_in_one_run_folder(slurm_cluster, tmp_path):
    started = time.monotonic()
    train = Path(__file__).resolve().parents[1] / "train.py"
    import sys

    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -N 2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
                      f"cd {tmp_path}\nsrun {sys.executable} {train} zero_stage=2 {' '.join(SHORT)}\n")
    submitted = slurm_cluster.run("sbatch", "--parsable", "-o", str(tmp_path / "slurm-%j.out"), str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    for _ in range(600):
        if not slurm_cluster.run("squeue", "-h", "-j", job_id).stdout.strip():
            break
        time.sleep(0.5)
    runs = [Path(p) for p in glob.glob(str(tmp_path / "outputs" / "*" / "*"))]
    assert len(runs) == 1, (runs, (tmp_path / f"slurm-{job_id}.out").read_text()[-3000:])
    summary = read_summary(runs[0])
    assert summary["status"] == "ok" and summary["slurm"]["job_id"] == job_id
    assert {r["node"] for r in summary["memory"]["per_rank"]} == NODES
    assert json.loads((runs[0] / "summary.node1.json").read_text())["node_rank"] == 1
    print(f"sbatch + srun on two nodes: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_a_rank_killed_on_one_node_fails_its_job_naming_node_and_rank_and_the_sweep_goes_on(slurm_cluster, tmp_path):
    """Job 0: rank 1, on the second node, dies of SIGKILL at step 2 (debug.kill_at_step), as a task the OOM killer
    or an operator kills. Job 1 of the same sweep is unharmed."""
    started = time.monotonic()
    proc = run_cli("-m", *ON_CLUSTER, "hydra.launcher.nodes=2", "zero_stage=2", *SHORT, "train.max_steps=4",
                   "debug.fail_rank=1", "debug.kill_at_step=2,null", "launch.collective_timeout_s=60",
                   cwd=tmp_path, env=slurm_cluster.env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    killed, unharmed = (read_summary(job) for job in sweep_jobs(tmp_path))
    error = killed["error"]
    assert killed["status"] == "failed", killed
    assert error["failed_rank"] == 1 and error["failed_node"] == "zt-node2" and error["failed_node_rank"] == 1
    assert error["message"].startswith("rank 1 on zt-node2 (node 1) was killed by SIGKILL"), error["message"]
    assert killed["slurm"]["state"] == "FAILED", killed["slurm"]  # node 0 exited 1: srun ended the step
    assert killed["wall_time_s"] < 60  # rank 0's run, kill included: well within launch.collective_timeout_s
    assert unharmed["status"] == "ok" and unharmed["steps"] == 4
    report = (sweep_jobs(tmp_path)[0].parent / "summary.md").read_text()
    assert "rank 1 on zt-node2" in report
    assert nothing_queued(slurm_cluster)
    print(f"killed rank on node 2, then a healthy job: {time.monotonic() - started:.1f} s")


def job_processes(cluster, job_id: str) -> dict[int, dict[str, str]]:
    """The processes of SLURM job `job_id` on this cluster (its batch script, srun, each node's task and workers),
    with their environment."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in v)
        except OSError:
            continue
        if env.get("SLURM_CONF") == str(cluster.conf) and env.get("SLURM_JOB_ID") == job_id:
            found[int(proc.name)] = env
    return found


def node_task(cluster, job_id: str, node_rank: int) -> int | None:
    """The pid of the job process of node `node_rank`: the task srun started there (job/slurm_task.py), not a rank."""
    for pid, env in job_processes(cluster, job_id).items():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"zerotune.job.slurm_task" in command and env.get("SLURM_NODEID") == str(node_rank):
            return pid
    return None


@pytest.mark.slow
def test_a_nodes_job_process_killed_fails_its_job_naming_that_node(slurm_cluster, tmp_path):
    """SIGKILL of node 1's job process (the task srun started on zt-node2, not a rank) in the middle of training:
    it writes nothing, srun ends the step and node 0's process with it. The job is recorded failed, naming
    zt-node2 (node 1) as srun saw it, in summary.json and on the sweep's console; nothing is left running."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers.cli import ROOT, cli_env, wait_for

    started = time.monotonic()
    sweep = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "-m", *ON_CLUSTER, "hydra.launcher.nodes=2",
                              "zero_stage=2", *SHORT, "train.max_steps=100000"], cwd=tmp_path,
                             env={**cli_env(), **slurm_cluster.env()}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    job_id = None
    try:
        def training() -> str | None:
            metrics = glob.glob(str(tmp_path / "multirun" / "*" / "*" / "0" / "metrics.jsonl"))
            running = slurm_cluster.run("squeue", "-h", "-t", "RUNNING", "-o", "%A").stdout.split()
            return running[0] if metrics and len(Path(metrics[0]).read_text().splitlines()) >= 3 and running \
                else None

        job_id = wait_for(training, 240, "three steps on two nodes")
        os.kill(wait_for(lambda: node_task(slurm_cluster, job_id, 1), 10, "node 1's task"), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
        if job_id and slurm_cluster.run("squeue", "-h", "-j", job_id).stdout.strip():
            slurm_cluster.run("scancel", job_id)
    assert sweep.returncode == 0, out[-3000:]
    (job,) = sweep_jobs(tmp_path)
    summary = read_summary(job)
    error = summary["error"]
    assert summary["status"] == "failed" and summary["slurm"]["state"] == "FAILED", (summary, out[-3000:])
    assert error["failed_node"] == "zt-node2" and error["failed_node_rank"] == 1 and error["signal"] == "SIGKILL"
    assert error["srun"] == "srun: error: zt-node2: task 1: Killed", error
    said = (f"SLURM job {job_id} ended without a result (state FAILED): the job process on zt-node2 (node 1) ended "
            f"first, killed by SIGKILL")
    assert error["message"].startswith(said), error["message"]
    assert f"{job.relative_to(tmp_path)}: {error['message']}" in out  # the sweep's console
    assert "the job process on zt-node2 (node 1)" in (job.parent / "summary.md").read_text()
    assert nothing_queued(slurm_cluster) and not job_processes(slurm_cluster, job_id)
    print(f"node 1's job process killed: recorded naming it {time.monotonic() - killed:.1f} s after the kill "
          f"(whole test {time.monotonic() - started:.1f} s)\n{error['message']}")


@pytest.mark.slow
def test_a_job_the_cluster_cancels_is_recorded_as_cancelled(slurm_cluster, tmp_path):
    """scancel while the job trains (it hangs at step 1): the sweep ends, and the job's summary says cancelled,
    not running."""
    import subprocess
    import sys

    started = time.monotonic()
    sweep = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "-m",
                              *ON_CLUSTER, "hydra.launcher.nodes=1", *SHORT, "debug.hang_at_step=1"],
                             cwd=tmp_path, env=slurm_cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        job_id = None
        for _ in range(240):
            listed = slurm_cluster.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split()
            if listed and glob.glob(str(tmp_path / "multirun" / "*" / "*" / "0" / "logs")):
                job_id = listed[0]
                break
            time.sleep(0.5)
        assert job_id, "the job never started"
        assert slurm_cluster.run("scancel", job_id).returncode == 0
        out, _ = sweep.communicate(timeout=300)
    finally:
        sweep.kill()
    (job,) = sweep_jobs(tmp_path)
    summary = read_summary(job)
    assert summary["status"] == "cancelled", (summary, out[-3000:])
    assert summary["slurm"]["state"] == "CANCELLED" and job_id.split("_")[0] in summary["error"]["message"]
    assert "| cancelled |" in (job.parent / "summary.md").read_text()
    assert nothing_queued(slurm_cluster)
    print(f"cancelled job recorded: {time.monotonic() - started:.1f} s")

"""Pre-emption that loses nothing, on a real SLURM cluster (the `slurm_cluster` fixture): a job interrupted in
the middle (submitit's SIGUSR2, or `scontrol requeue`) saves, is requeued, and its next attempt continues in the
same run dir; the result is bit for bit the uninterrupted job's, and every attempt is on record."""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import ROOT, cli_env, read_losses, read_summary, run_cli, wait_for

STEPS = 24
# The tiny U-Net on synthetic 8 px data in fp32 (exact on the CPU), a loss logged every step, a save on the signal.
# timeout_min=30: submitit counts a signal in the first 80% of the limit (at most limit - 10 min) as pre-emption,
# which it requeues; a later one as a time-out, requeued only hydra.launcher.max_num_timeout times (default 0).
JOB = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null",
       "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=30", "data=synthetic", "model=tiny",
       "resolution=8", "train.batch_size=8", "evaluate.enabled=false", "precision=fp32", "scheduler=constant",
       "train.log_every=1", "checkpoint.on_signal=true", f"train.max_steps={STEPS}"]


def job_folder(cwd: Path) -> Path | None:
    found = glob.glob(str(cwd / "multirun" / "*" / "*" / "0"))
    return Path(found[0]) if found else None


def steps_logged(job: Path | None) -> int:
    metrics = job / "metrics.jsonl" if job else None
    return len(metrics.read_text().splitlines()) if metrics and metrics.is_file() else 0


def queued(cluster) -> list[tuple[str, str]]:
    out = cluster.run("squeue", "-h", "-o", "%i %T").stdout.split()
    return list(zip(out[::2], out[1::2], strict=True))


def requeued_and_running(cluster, job_id: str) -> bool:
    """The job's next attempt has started; a requeued job that still waits (SLURM holds one back for about two
    minutes) is let go at once."""
    shown = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    state, restarts = re.search(r"\bJobState=(\w+)", shown), re.search(r"\bRestarts=(\d+)", shown)
    if not (state and restarts and int(restarts[1]) >= 1):
        return False
    if state[1] == "PENDING":
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        return False
    return True


def exported(run_dir: Path, out: Path) -> dict:
    proc = run_cli(str(run_dir), str(out), module="zerotune.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "unet.safetensors"))


def sweep(cwd: Path, cluster, nodes: int) -> subprocess.Popen:
    cwd.mkdir()
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), "-m", *JOB, f"hydra.launcher.nodes={nodes}"],
                            cwd=cwd,
                            env={**cli_env(), **cluster.env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def interrupt_and_release(cluster, cwd: Path, how: str) -> str:
    """Once the job has logged a few steps: interrupt it, and see its requeued attempt start."""
    job = wait_for(lambda: steps_logged(job_folder(cwd)) >= 3 and job_folder(cwd), 240, "three steps")
    (job_id, state), = queued(cluster)
    assert state == "RUNNING" and steps_logged(job) < STEPS
    if how == "usr2":  # what SLURM sends at submitit's --signal=USR2@<signal_delay_s>: every task of the job
        cmd = ["scancel", "--signal=USR2", job_id]
    else:
        cmd = ["scontrol", "requeue", job_id]
    done = cluster.run(*cmd)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: requeued_and_running(cluster, job_id), 180, "the requeued job to start")
    return job_id


@pytest.mark.slow
@pytest.mark.parametrize(("how", "nodes"), [("usr2", 1), ("scontrol_requeue", 1), ("usr2", 2)])
def test_a_preempted_job_saves_is_requeued_and_ends_as_if_never_stopped(slurm_cluster, tmp_path, how, nodes):
    """On two nodes SLURM signals both nodes' tasks; each saves its shards, node 0's requeues the job."""
    started = time.monotonic()
    proc = sweep(tmp_path / "preempted", slurm_cluster, nodes)
    try:
        job_id = interrupt_and_release(slurm_cluster, tmp_path / "preempted", how)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    preempted = time.monotonic() - started

    job = job_folder(tmp_path / "preempted")
    final, first = read_summary(job), read_summary(job / "attempts" / "1")
    # The first attempt: stopped by the signal after step k, with a checkpoint of step k.
    assert first["status"] == "interrupted", first.get("error")
    k = first["interrupted"]["after_step"]
    assert 3 <= k < STEPS and first["steps"] == k
    assert first["interrupted"]["job_signal"] == ("SIGUSR2" if how == "usr2" else "SIGTERM")
    assert Path(first["checkpoint"]["last_complete"]).name == f"step-{k:07d}"
    assert first["slurm"]["job_id"] == job_id and first["slurm"]["restart_count"] == 0
    # The requeued attempt: same SLURM job, same run dir, continued from step k to the end.
    assert final["status"] == "ok" and final["steps"] == STEPS, final.get("error")
    assert final["slurm"]["job_id"] == job_id and final["slurm"]["restart_count"] == 1
    assert final["slurm"]["num_nodes"] == nodes and len(final["memory"]["per_rank"]) == nodes
    assert final["previous_attempts"] == ["attempts/1"]
    assert final["checkpoint"]["resumed_from"]["step"] == k
    assert Path(final["checkpoint"]["resumed_from"]["path"]).name == f"step-{k:07d}"

    reference = sweep(tmp_path / "straight", slurm_cluster, nodes)
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, out[-3000:] + err[-3000:]
    straight = job_folder(tmp_path / "straight")
    assert read_summary(straight)["slurm"]["restart_count"] == 0
    # Steps 1..k from the first attempt and k+1.. from the second are the uninterrupted job's losses, exactly.
    assert read_losses(job / "attempts" / "1") + read_losses(job) == read_losses(straight)
    assert [json.loads(line)["step"] for line in (job / "metrics.jsonl").read_text().splitlines()][0] == k + 1
    ours, theirs = exported(job, tmp_path / "ours"), exported(straight, tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    assert all(ours[name].equal(theirs[name]) for name in ours)
    print(f"{how} on {nodes} node(s): pre-empted at step {k} of {STEPS}, requeued and finished: {preempted:.1f} s "
          f"(whole test {time.monotonic() - started:.1f} s)")


# ---------------------------------------------------------------- fast: the rules, without a cluster


def test_a_requeued_attempt_continues_its_jobs_newest_checkpoint(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from zerotune import checkpoints
    from zerotune.launch.slurm import continue_requeued

    def cfg(path=None):
        return OmegaConf.create({"resume": {"path": path, "strict": False}, "checkpoint": {"dir": None}})

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    first = cfg()
    assert not continue_requeued(first, tmp_path) and first.resume.path is None  # nothing saved yet: as at first
    folder = checkpoints.step_dir(tmp_path / "checkpoints", 4)
    folder.mkdir(parents=True)
    (folder / checkpoints.META).write_text('{"step": 4}')
    (folder / checkpoints.COMPLETE).write_text("4\n")
    for start in (None, "/elsewhere/step-0000100"):  # the first attempt's start gives way to the job's own save
        again = cfg(start)
        assert continue_requeued(again, tmp_path) and again.resume.path == "auto"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert not continue_requeued(cfg(), tmp_path)


def test_submitits_requeue_is_called_after_the_save_on_its_signal_only(monkeypatch):
    import signal

    from zerotune.launch.slurm import requeue_if_preempted

    calls = []

    class SignalHandler:  # submitit's (job_environment.py): SIGUSR2 requeues, SIGTERM is ignored
        def checkpoint_and_try_requeue(self, signum, frame):
            calls.append(signum)

        def bypass(self, signum, frame):
            pass

    handler = SignalHandler()
    monkeypatch.setattr(signal, "getsignal", lambda sig: handler.checkpoint_and_try_requeue
                        if sig == signal.SIGUSR2 else handler.bypass)
    requeue_if_preempted({"interrupted": {"signal": "SIGTERM", "job_signal": "SIGTERM"}})
    requeue_if_preempted({"status": "ok"})
    assert calls == []
    requeue_if_preempted({"interrupted": {"signal": "SIGUSR2", "job_signal": "SIGUSR2"}})
    assert calls == [signal.SIGUSR2]

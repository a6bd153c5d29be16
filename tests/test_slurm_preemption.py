"""Pre-emption that loses nothing, on a real SLURM cluster (the `slurm_cluster` fixture): a job interrupted in
the middle (submitit's SIGUSR2, or `scontrol requeue`) saves, is requeued, and its next attempt continues in the
same run dir; the result is bit for bit the uninterrupted job's, and every attempt is on record."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import ROOT, cli_env, read_losses, read_summary, run_cli, wait_for
from tests.helpers.slurm import catches

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


def await_next_attempt(cluster, job_id: str, restarts: int = 1, timeout: float = 240) -> None:
    """Until the job's attempt after `restarts` requeues runs. SLURM holds a requeued job back for about two
    minutes; here it is let go once it has been pending two seconds (slurmd refuses to start a job in the second
    it killed it: its credential counts as revoked, and the job ends FAILED)."""
    pending_since = None

    def running() -> bool:
        nonlocal pending_since
        shown = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
        state, done = re.search(r"\bJobState=(\w+)", shown), re.search(r"\bRestarts=(\d+)", shown)
        if not (state and done and int(done[1]) >= restarts):
            return False
        if state[1] == "PENDING":
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since > 2:
                cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        return state[1] == "RUNNING"  # not COMPLETING: the last attempt's end, before the job is pending again

    wait_for(running, timeout, f"attempt {restarts + 1} of job {job_id} to start")


def exported(run_dir: Path, out: Path) -> dict:
    proc = run_cli("export", str(run_dir), str(out), module="zerotune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "unet.safetensors"))


def sweep(cwd: Path, cluster, nodes: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cwd.mkdir()
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), "-m", *JOB, f"hydra.launcher.nodes={nodes}",
                             *extra], cwd=cwd, env={**cli_env(), **cluster.env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    await_next_attempt(cluster, job_id)
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


# ---------------------------------------------------------------- a stop signal at any moment of an attempt

PAUSE_S = 8  # how long each attempt waits at the moment under test (zerotune/host/process.py): the signal lands there


def paused_at(moment: str, folder: Path) -> dict:
    return {"ZEROTUNE_TEST_PAUSE": f"{moment}:{PAUSE_S}", "ZEROTUNE_TEST_PAUSE_DIR": str(folder)}


def preempt(cluster, job_id: str, restarts: int, how: str = "usr2") -> None:
    """Signal every task of the job as SLURM does before a pre-emption (or requeue it), and see the attempt after
    `restarts` requeues start."""
    cmd = {"usr2": ["scancel", "--signal=USR2", job_id], "scontrol_requeue": ["scontrol", "requeue", job_id],
           # the batch script's shell too, which would end the job FAILED without its trap (hydra_plugins)
           "usr2_full": ["scancel", "--full", "--signal=USR2", job_id]}[how]
    done = cluster.run(*cmd)
    assert done.returncode == 0, done.stderr
    await_next_attempt(cluster, job_id, restarts)


def task_pids(cluster, restarts: int) -> list[int]:
    """This cluster's SLURM tasks of hydra/launcher=slurm (job/slurm_task.py) in the attempt after `restarts`
    requeues, that hold the stop signals already (their imports still going on)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode().split("\0") if "=" in v)
        except OSError:
            continue
        if (b"zerotune.job.slurm_task" in command and env.get("SLURM_CONF") == str(cluster.conf)
                and int(env.get("SLURM_RESTART_COUNT") or 0) == restarts and catches(int(proc.name), signal.SIGUSR2)):
            found.append(int(proc.name))
    return found


def check_attempts(job: Path, cluster, job_id: str, signals: list[str]) -> dict:
    """Every attempt on record: the earlier ones interrupted by `signals`, each with its own restart count; the last
    one completed, with SLURM's count of the job's requeues (scontrol's Restarts)."""
    shown = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    restarts = int(re.search(r"\bRestarts=(\d+)", shown)[1])
    final = read_summary(job)
    assert final["status"] == "ok" and final["steps"] == STEPS, final.get("error")
    assert final["slurm"]["restart_count"] == restarts == len(signals)
    assert final["previous_attempts"] == [f"attempts/{n}" for n in range(1, restarts + 1)]
    for n, name in enumerate(signals, start=1):
        earlier = read_summary(job / "attempts" / str(n))
        assert earlier["status"] == "interrupted", earlier.get("error")
        assert earlier["interrupted"]["job_signal"] == name and earlier["slurm"]["restart_count"] == n - 1
    return final


def first_step_logged(job: Path) -> int:
    return json.loads((job / "metrics.jsonl").read_text().splitlines()[0])["step"]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["before_workers", "worker_imports", "engine_build"])
def test_an_attempt_preempted_before_it_trains_is_recorded_requeued_and_continued(slurm_cluster, tmp_path, moment):
    """The first attempt is pre-empted in the middle of training and saves step k; the second, at `moment` (before
    its job process starts the workers, while they import, while they build the engine): it holds the signal,
    records itself, saves nothing (nothing trained) and is requeued; the third continues from step k."""
    cwd, pauses = tmp_path / "job", tmp_path / "pauses"
    proc = sweep(cwd, slurm_cluster, 1, env=paused_at(moment, pauses))
    try:
        wait_for(lambda: steps_logged(job_folder(cwd)) >= 3, 240, "three steps")
        (job_id, _), = queued(slurm_cluster)
        seen = set(pauses.glob(f"{moment}.*"))  # the first attempt's
        preempt(slurm_cluster, job_id, restarts=1)
        wait_for(lambda: set(pauses.glob(f"{moment}.*")) - seen, 240, f"the second attempt at {moment}")
        preempt(slurm_cluster, job_id, restarts=2)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    job = job_folder(cwd)
    final = check_attempts(job, slurm_cluster, job_id, ["SIGUSR2", "SIGUSR2"])
    k = read_summary(job / "attempts" / "1")["interrupted"]["after_step"]
    second = read_summary(job / "attempts" / "2")
    assert not second["checkpoint"].get("saved") and Path(second["checkpoint"]["last_complete"]).name == f"step-{k:07d}"
    assert final["checkpoint"]["resumed_from"]["step"] == k and first_step_logged(job) == k + 1


@pytest.mark.slow
@pytest.mark.parametrize(("step", "how"), [(8, "usr2"), (STEPS, "usr2"), (8, "usr2_full")])
def test_an_attempt_preempted_while_it_saves_finishes_the_save_and_is_continued_from_it(slurm_cluster, tmp_path, step,
                                                                                        how):
    """USR2 in the middle of a periodic save (step 8), or of the final one: the save completes, the attempt is
    recorded as interrupted after that step and requeued, and the next continues from that checkpoint. usr2_full:
    the batch script's shell is signalled too."""
    cwd, pauses = tmp_path / "job", tmp_path / "pauses"
    proc = sweep(cwd, slurm_cluster, 1, "checkpoint.every_n_steps=8", env=paused_at(f"save-{step}", pauses))
    try:
        wait_for(lambda: list(pauses.glob(f"save-{step}.*")), 300, f"the save of step {step}")
        (job_id, _), = queued(slurm_cluster)
        preempt(slurm_cluster, job_id, restarts=1, how=how)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    job = job_folder(cwd)
    final = check_attempts(job, slurm_cluster, job_id, ["SIGUSR2"])
    first = read_summary(job / "attempts" / "1")
    assert first["interrupted"]["after_step"] == first["steps"] == step
    assert Path(first["checkpoint"]["last_complete"]).name == f"step-{step:07d}"
    assert final["checkpoint"]["resumed_from"]["step"] == step


@pytest.mark.slow
def test_three_preemptions_in_a_row_as_each_attempt_starts_keep_the_job_and_its_history(slurm_cluster, tmp_path):
    """On two nodes: USR2 in the middle of training; then `scontrol requeue`, and USR2 again, each as soon as the
    requeued attempt's tasks are up (holding the signals, their imports going on). Each attempt records itself;
    the fourth continues from the first one's checkpoint and completes, with SLURM's count of requeues."""
    cwd = tmp_path / "job"
    proc = sweep(cwd, slurm_cluster, 2)
    try:
        job_id = interrupt_and_release(slurm_cluster, cwd, "usr2")
        wait_for(lambda: len(task_pids(slurm_cluster, 1)) == 2, 240, "the second attempt's tasks")
        preempt(slurm_cluster, job_id, restarts=2, how="scontrol_requeue")
        wait_for(lambda: len(task_pids(slurm_cluster, 2)) == 2, 240, "the third attempt's tasks")
        preempt(slurm_cluster, job_id, restarts=3)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    job = job_folder(cwd)
    final = check_attempts(job, slurm_cluster, job_id, ["SIGUSR2", "SIGTERM", "SIGUSR2"])
    k = read_summary(job / "attempts" / "1")["interrupted"]["after_step"]
    assert final["checkpoint"]["resumed_from"]["step"] == k and first_step_logged(job) == k + 1
    assert final["slurm"]["num_nodes"] == 2 and len(final["memory"]["per_rank"]) == 2


# ---------------------------------------------------------------- fast: the rules, without a cluster


def test_a_requeued_attempt_continues_its_jobs_newest_checkpoint(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from zerotune.job.slurm import continue_requeued
    from zerotune.rundir import checkpoints

    def cfg(path=None):
        return OmegaConf.create({"resume": {"path": path, "strict": False}, "checkpoint": {"dir": None}})

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    first = cfg()
    assert not continue_requeued(first, tmp_path)  # nothing saved yet: as at first
    folder = checkpoints.step_dir(tmp_path / "checkpoints", 4)
    folder.mkdir(parents=True)
    (folder / checkpoints.META).write_text('{"step": 4}')
    (folder / checkpoints.COMPLETE).write_text("4\n")
    for start in (None, "/elsewhere/step-0000100"):  # the first attempt's start gives way to the job's own save
        again = cfg(start)
        assert continue_requeued(again, tmp_path) and again.resume.path == start  # the config itself is left alone
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert not continue_requeued(cfg(), tmp_path)


def test_submitits_requeue_is_called_after_the_save_on_its_signal_only(monkeypatch):
    import signal

    from zerotune.job.slurm import requeue_if_preempted
    from zerotune.rundir.summary import RunSummary, Status

    calls = []

    class SignalHandler:  # submitit's (job_environment.py): SIGUSR2 requeues, SIGTERM is ignored
        def checkpoint_and_try_requeue(self, signum, frame):
            calls.append(signum)

        def bypass(self, signum, frame):
            pass

    handler = SignalHandler()
    monkeypatch.setattr(signal, "getsignal", lambda sig: handler.checkpoint_and_try_requeue
                        if sig == signal.SIGUSR2 else handler.bypass)
    requeue_if_preempted(RunSummary(interrupted={"signal": "SIGTERM", "job_signal": "SIGTERM"}))
    requeue_if_preempted(RunSummary(status=Status.OK))
    assert calls == []
    requeue_if_preempted(RunSummary(interrupted={"signal": "SIGUSR2", "job_signal": "SIGUSR2"}))
    assert calls == [signal.SIGUSR2]


def test_a_stop_signal_while_the_job_process_imports_starts_no_worker_and_is_recorded(tmp_path):
    """USR2 as soon as train.py holds it, in the middle of its imports: the process survives it, starts no worker,
    records the job as interrupted and exits as the signal says (128 + SIGUSR2). Without the hold from train.py's
    first line it would die of the signal; without the launcher's look at it, its workers would start and train."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "data=synthetic", "model=tiny", "resolution=8",
                             "train.batch_size=8", "evaluate.enabled=false", "train.max_steps=4",
                             f"hydra.run.dir={run}"], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: catches(proc.pid, signal.SIGUSR2) or proc.poll() is not None, 60, "train.py to hold USR2")
        os.kill(proc.pid, signal.SIGUSR2)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR2, err[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["interrupted"]["signal"] == "SIGUSR2"
    assert summary["interrupted"]["after_step"] is None
    assert not list(run.glob("logs/**/stderr.log")) and not (run / "metrics.jsonl").exists()  # no worker started


def test_a_slurm_task_signalled_as_it_starts_requeues_its_job_once_recorded(tmp_path):
    """The command srun runs for hydra/launcher=slurm (job/slurm_task.py), on a submitit job of this machine: USR2
    while it imports the job's code, and again once submitit's handler is installed. Neither ends it nor requeues
    the job there and then: the job reads the held signal, and only then submitit's handler runs `scontrol
    requeue` and exits as submitit does after a requeue (255)."""
    import submitit

    from tests.helpers.held_job import held_job

    folder, bin_dir = tmp_path / "submitit", tmp_path / "bin"
    folder.mkdir()
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # records the requeue instead of asking a cluster
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    scontrol.chmod(0o755)
    delayed = submitit.helpers.DelayedSubmission(held_job, str(tmp_path))
    delayed.set_timeout(30, 3)  # 30 min: a signal now is a pre-emption, which submitit requeues
    delayed.dump(folder / "42_submitted.pkl")
    env = {**cli_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "HELD_JOB_DIR": str(tmp_path),
           "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "localhost"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "zerotune.job.slurm_task", str(folder)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "importing").exists() or proc.poll() is not None, 60, "the job's import")
        os.kill(proc.pid, signal.SIGUSR2)  # before submitit's handler exists
        (tmp_path / "imported").touch()
        wait_for(lambda: (tmp_path / "running").exists() or proc.poll() is not None, 60, "the job to run")
        os.kill(proc.pid, signal.SIGUSR2)  # with submitit's handler installed, and set aside
        time.sleep(0.5)
        assert not (tmp_path / "scontrol.calls").exists()  # not requeued when the signal came
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 255, err[-3000:]
    assert (tmp_path / "recorded").read_text() == "SIGUSR2"
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "42"]


def test_an_attempt_that_left_no_record_gets_one_so_the_job_keeps_one_per_attempt(tmp_path):
    """The fourth attempt of SLURM job 7 (three requeues) finds records of the first (its summary) and the second
    (killed before its summary: its config names the job), and of an earlier job in the same folder; the third
    attempt left nothing. It is recorded as lost, so the job's attempts are as many as SLURM's restarts."""
    from zerotune.job.slurm import record_lost_attempts

    def attempt(n: int, name: str, text: str) -> None:
        (tmp_path / "attempts" / str(n)).mkdir(parents=True)
        (tmp_path / "attempts" / str(n) / name).write_text(text)

    attempt(1, "summary.json", json.dumps({"status": "ok", "slurm": {"job_id": "3"}}))  # an earlier job's
    attempt(2, "summary.json", json.dumps({"status": "interrupted", "slurm": {"job_id": "7", "restart_count": 0}}))
    attempt(3, "config.yaml", "launch:\n  run_id: slurm-7\n")
    env = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3", "SLURM_JOB_NODELIST": "zt-node1"}
    assert record_lost_attempts(tmp_path, env) == ["attempts/4"]
    lost = read_summary(tmp_path / "attempts" / "4")
    assert lost["status"] == "lost" and lost["slurm"]["job_id"] == "7" and lost["slurm"]["restart_count"] == 2
    assert record_lost_attempts(tmp_path, env) == []  # on record now
    assert record_lost_attempts(tmp_path / "elsewhere", {**env, "SLURM_RESTART_COUNT": "0"}) == []

"""Faults lose nothing: a killed job leaves no worker, a full disk or a damaged checkpoint is named and
survived, two jobs never share a checkpoint dir, a stop signal ends a run cleanly, a rerun keeps the
earlier run's records. Every fault is injected into the real CLI, run as a subprocess."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import ROOT, cli_env, read_summary, run_cli, wait_for
from zerotune.rundir import checkpoints, resume

SHORT = ["evaluate.enabled=false", "scheduler=constant", "train.batch_size=8", "train.log_every=1"]


def start_cli(*args: str, new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SHORT, *args], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


def workers_of(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "zerotune.job.bootstrap" in cmd and str(run_dir) in cmd:  # python -u -m zerotune.job.bootstrap
            found.append(proc)
    return found


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


# ---------------------------------------------------------------------------- 1. orphaned workers


@pytest.mark.parametrize("delay_s", [pytest.param(0.0, marks=pytest.mark.slow), 1.0,
                                     pytest.param(3.0, marks=pytest.mark.slow)])
def test_killing_the_job_kills_its_workers_at_any_moment_of_their_start(tmp_path, delay_s):
    """kill -9 of the job's process group while its worker is still importing: the worker (in a session of
    its own, started by torch's launcher) must not survive its parent."""
    run_dir = tmp_path / "run"
    job = start_cli("train.max_steps=50", f"hydra.run.dir={run_dir}", new_session=True)
    workers = wait_for(lambda: workers_of(run_dir), what="the worker to start")
    time.sleep(delay_s)
    psutil.Process(job.pid).send_signal(signal.SIGKILL)  # the launcher's agent dies without a word
    job.wait(30)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived the killed job: {[p.pid for p in alive]}"


# ---------------------------------------------------------------------------- 2. disk full


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size (needs root, as on CI); skipped where it cannot be mounted."""
    mounted = []

    def make(mib: int) -> Path:
        point = tmp_path / f"disk{mib}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_save_that_would_not_fit_is_refused_before_writing(tmp_path, small_disk):
    disk, run_dir = small_disk(15), tmp_path / "run"   # one tiny-model checkpoint is ~9.3 MiB: one fits, two do not
    proc = run_cli(*SHORT, "train.max_steps=6", "checkpoint.every_n_steps=2", f"checkpoint.dir={disk / 'ck'}",
                   f"hydra.run.dir={run_dir}")
    assert proc.returncode == 1
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["steps"] == 4
    assert summary["error"]["type"] == "CheckpointSpaceError"
    message = summary["error"]["message"]
    assert str(disk / "ck") in message and "MiB are free" in message and "size of step-0000002" in message
    assert summary["checkpoint"]["last_complete"] == str(disk / "ck" / "step-0000002")
    assert sorted(p.name for p in (disk / "ck").iterdir() if not p.name.startswith(".zerotune")) == \
        ["latest", "step-0000002"], "nothing partial is left on the full disk"


@pytest.mark.slow
def test_a_save_that_runs_out_of_space_midway_is_removed_and_named(tmp_path, small_disk):
    """The first save's estimate (weights and two moments: 7.2 MiB with its margin, for the tiny U-Net's 0.6M
    parameters) is below its real size (9.3 MiB): 8 MiB pass the check and fill up during the save."""
    disk, run_dir = small_disk(8), tmp_path / "run"
    proc = run_cli(*SHORT, "train.max_steps=4", "checkpoint.every_n_steps=2", f"checkpoint.dir={disk / 'ck'}",
                   f"hydra.run.dir={run_dir}")
    assert proc.returncode == 1
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["steps"] == 2
    assert summary["error"]["type"] == "CheckpointSpaceError"
    assert "ran out of space while saving" in summary["error"]["message"]
    assert summary["checkpoint"]["last_complete"] is None
    assert not [p for p in (disk / "ck").iterdir() if p.name.startswith(".tmp-step-")]
    assert shutil.disk_usage(disk).used < 2**20, "the partial save was removed"


class _FakeAccelerator:
    """Just enough of accelerate's Accelerator for store.save: its state write fails like a full disk."""

    is_main_process, process_index = True, 0

    def wait_for_everyone(self):
        pass

    def save_state(self, folder):
        (Path(folder) / "pytorch_model").mkdir()
        (Path(folder) / "pytorch_model" / "part.pt").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_save_unit(tmp_path):
    from zerotune.rundir.checkpoint_io import SaveRequest, save

    request = SaveRequest(root=tmp_path / "ck", step=3, meta={}, position_state={}, unet=None, job="j")
    with pytest.raises(checkpoints.CheckpointSpaceError) as err:
        save(_FakeAccelerator(), request)
    assert "ran out of space while saving" in str(err.value) and str(tmp_path / "ck") in str(err.value)
    assert list((tmp_path / "ck").iterdir()) == [], "the partial folder is gone"


# ---------------------------------------------------------------------------- 3. damaged checkpoints


@pytest.fixture
def two_checkpoints(offload_run):
    """A run dir with checkpoints at steps 2 and 4 (the session's offload=cpu run: tests/conftest.py)."""
    run_dir, _ = offload_run
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run_dir, dest)
    return dest


def optimizer_file(step_folder: Path) -> Path:
    return next(step_folder.rglob("*optim_states.pt"))


def test_manifest_names_truncated_missing_and_altered_files(two_checkpoints, tmp_path):
    folder = copy_of(two_checkpoints, tmp_path) / "checkpoints" / "step-0000004"
    assert checkpoints.problems(folder) == []
    record = json.loads((folder / checkpoints.COMPLETE).read_text())
    assert record["step"] == 4 and "meta.json" in record["files"]
    optim = optimizer_file(folder)
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0xFF                                   # same size, one bit flipped
    optim.write_bytes(bytes(data))
    (folder / "meta.json").write_text('{"step": 4, "zero')          # truncated
    (folder / "config.json").unlink()
    found = "\n".join(checkpoints.problems(folder))
    assert "sha256 differs" in found and "meta.json: 17 bytes" in found and "config.json: missing" in found


@pytest.mark.slow
def test_resume_falls_back_past_a_truncated_newest_checkpoint(two_checkpoints, tmp_path):
    run_dir = copy_of(two_checkpoints, tmp_path)
    optim = optimizer_file(run_dir / "checkpoints" / "step-0000004")
    with open(optim, "r+b") as fh:
        fh.truncate(1000)
    proc = run_cli(*SHORT, "train.max_steps=5", "resume=latest", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr  # the warning is logged (Hydra's console log goes to stdout)
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-0000004'} is damaged" in said and optim.name in said
    summary = read_summary(run_dir)
    assert summary["checkpoint"]["resumed_from"]["step"] == 2 and summary["steps"] == 5


def test_strict_resume_stops_on_a_damaged_checkpoint_with_the_fix(two_checkpoints, tmp_path):
    run_dir = copy_of(two_checkpoints, tmp_path)
    (run_dir / "checkpoints" / "step-0000004" / "meta.json").write_text('{"step": 4')
    saves_before = sorted((run_dir / "checkpoints").iterdir())
    proc = run_cli(*SHORT, "train.max_steps=5", "resume=latest", "resume.strict=true", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    # Refused by the job's checks: the workers were turned away at the gate, before training or saving.
    assert "step 5/" not in proc.stdout + proc.stderr and not (run_dir / "metrics.jsonl").exists()
    assert sorted((run_dir / "checkpoints").iterdir()) == saves_before
    assert "`resume.path`" in proc.stderr and "meta.json" in proc.stderr
    assert f"resume={run_dir / 'checkpoints' / 'step-0000002'}" in proc.stderr


# ---------------------------------------------------------------------------- 4. one job per checkpoint dir


def test_a_second_job_on_a_busy_checkpoint_dir_is_refused_naming_the_first(tmp_path):
    """The first job then gets SIGTERM and ends cleanly, saving a last checkpoint: the default suite's case of
    test_a_stop_signal_ends_the_job_cleanly (one long job for both)."""
    shared, run_dir = tmp_path / "shared_ck", tmp_path / "a"
    first = start_cli("train.max_steps=100000", "checkpoint.every_n_steps=1000", "checkpoint.on_signal=true",
                      f"checkpoint.dir={shared}", f"hydra.run.dir={run_dir}")
    try:
        wait_for(lambda: (shared / resume.OWNER_FILE).is_file(), what="the first job's lock")
        proc = run_cli(*SHORT, "train.max_steps=2", "checkpoint.every_n_steps=1", f"checkpoint.dir={shared}",
                       f"hydra.run.dir={tmp_path / 'b'}")
        assert proc.returncode == 2
        assert "`checkpoint.dir`" in proc.stderr and f"the job in {run_dir}" in proc.stderr
        assert read_summary(tmp_path / "b")["error"]["key"] == "checkpoint.dir"
        assert first.poll() is None, "the first job runs on"
        wait_for(lambda: steps_logged(run_dir) >= 3, what="three steps")
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    check_stopped_cleanly(first, err, run_dir, shared, signal.SIGTERM, 143, on_signal=True)


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from zerotune.rundir.resume import CheckpointDirLock\n"
        f"held = CheckpointDirLock({str(tmp_path)!r}, 'holder-run').acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=cli_env())
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(Exception) as err:
        resume.CheckpointDirLock(tmp_path, "me").acquire()
    assert "holder-run" in str(err.value)
    holder.kill()
    holder.wait()
    with resume.CheckpointDirLock(tmp_path, "me"):
        assert json.loads((tmp_path / resume.OWNER_FILE).read_text())["run_dir"] == "me"


def test_temporary_folders_are_private_to_a_job(tmp_path):
    a, b = checkpoints.tmp_dir(tmp_path, 1, checkpoints.job_token(tmp_path / "a")), \
        checkpoints.tmp_dir(tmp_path, 1, checkpoints.job_token(tmp_path / "b"))
    assert a != b and a.name.startswith(".tmp-step-0000001-")


# ---------------------------------------------------------------------------- 5. stop signals


def check_stopped_cleanly(job: subprocess.Popen, err: str, run_dir: Path, checkpoint_dir: Path, sig, code: int,
                          on_signal: bool) -> None:
    """A job that `sig` stopped after its third step: its exit code, no traceback, an interrupted record, a last
    checkpoint where on_signal asks for one, and no worker left."""
    assert job.returncode == code, err[-2000:]
    assert "Traceback" not in err and "SignalException" not in err
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["steps"] >= 3
    assert summary["interrupted"]["signal"] == sig.name
    saved = summary["checkpoint"]["last_complete"]
    assert (saved == str(checkpoints.step_dir(checkpoint_dir, summary["steps"]))) if on_signal else saved is None
    assert not workers_of(run_dir)


# SIGTERM with on_signal, in the default suite: test_a_second_job_on_a_busy_checkpoint_dir_is_refused_naming_the_first
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "on_signal"), [(signal.SIGINT, 130, False), (signal.SIGUSR1, 138, True)])
def test_a_stop_signal_ends_the_job_cleanly(tmp_path, sig, code, on_signal):
    run_dir = tmp_path / "run"
    job = start_cli("train.max_steps=100000", f"checkpoint.on_signal={str(on_signal).lower()}",
                    f"hydra.run.dir={run_dir}")
    wait_for(lambda: steps_logged(run_dir) >= 3, what="three steps")
    job.send_signal(sig)
    _, err = job.communicate(timeout=120)
    check_stopped_cleanly(job, err, run_dir, run_dir / "checkpoints", sig, code, on_signal)


@pytest.mark.slow
def test_an_interrupted_run_resumes_in_place_without_loss(tmp_path):
    run_dir = tmp_path / "run"
    job = start_cli("train.max_steps=100000", "checkpoint.on_signal=true", f"hydra.run.dir={run_dir}")
    wait_for(lambda: steps_logged(run_dir) >= 2, what="two steps")
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=120)
    stopped_at = read_summary(run_dir)["steps"]
    proc = run_cli(*SHORT, f"train.max_steps={stopped_at + 2}", "resume=latest", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["checkpoint"]["resumed_from"]["step"] == stopped_at and summary["steps"] == stopped_at + 2
    assert read_summary(run_dir / "attempts" / "1")["status"] == "interrupted"


# ---------------------------------------------------------------------------- 6. reruns keep records


@pytest.mark.slow
def test_a_failed_rerun_keeps_the_first_runs_records(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(*SHORT, "train.max_steps=3", f"hydra.run.dir={run_dir}").returncode == 0
    first_config = (run_dir / "config.yaml").read_text()
    proc = run_cli(*SHORT, "train.max_steps=3", f"resume={tmp_path / 'nothing'}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    kept = run_dir / "attempts" / "1"
    assert read_summary(kept)["status"] == "ok" and read_summary(kept)["steps"] == 3
    assert (kept / "config.yaml").read_text() == first_config and (kept / "ds_config.json").is_file()
    assert (kept / "metrics.jsonl").is_file()
    now = read_summary(run_dir)
    assert now["status"] == "failed" and now["previous_attempts"] == ["attempts/1"]


SUBMITIT_LIKE = """
import signal, sys
# What submitit does in the job process on SLURM's pre-emption signal (USR2): requeue, then sys.exit(-1).
signal.signal(signal.SIGUSR2, lambda signum, frame: sys.exit(-1))
from zerotune.cli.train import main
sys.argv = ["train.py", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_slurm_preemption_saves_and_the_requeued_job_resumes(tmp_path):
    """hydra/launcher=slurm: submitit exits the job process on pre-emption; the workers still save
    (checkpoint.on_signal), and the requeued job (same command, same run dir, resume=auto) continues."""
    run_dir = tmp_path / "run"
    args = [*SHORT, "checkpoint.on_signal=true", "resume=auto", f"hydra.run.dir={run_dir}"]
    job = subprocess.Popen([sys.executable, "-c", SUBMITIT_LIKE, "train.max_steps=100000", *args], cwd=ROOT,
                           env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: steps_logged(run_dir) >= 3, what="three steps")
    job.send_signal(signal.SIGUSR2)
    job.communicate(timeout=120)
    stopped = read_summary(run_dir)
    assert stopped["status"] == "interrupted" and stopped["checkpoint"]["last_complete"]
    proc = run_cli(*args, f"train.max_steps={stopped['steps'] + 2}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_summary(run_dir)["checkpoint"]["resumed_from"]["step"] == stopped["steps"]


@pytest.mark.slow
def test_resume_auto_starts_fresh_when_there_is_nothing_to_continue(tmp_path):
    proc = run_cli(*SHORT, "train.max_steps=2", "resume=auto", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed_from" not in read_summary(tmp_path / "run")["checkpoint"]

"""A run that completes its steps ends with a checkpoint of its last step (checkpoint.final, on by default),
so `python -m zerotune export <run dir> <out>` works with no other flag."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DEFAULT_JOB_STEPS
from tests.helpers.cli import compose_cfg, read_summary, run_cli
from zerotune.rundir import checkpoints, resume
from zerotune.rundir.checkpoint_io import cleanup
from zerotune.rundir.export import find_checkpoint

SHORT = ["train.batch_size=8", "evaluate.enabled=false"]
LIVE_COPY = ["ema.enabled=true", "ema.decay=0"]  # as the default job run's (tests/conftest.py)
STEPS = DEFAULT_JOB_STEPS


def train(run_dir, *args, expect: int = 0) -> dict:
    proc = run_cli(*SHORT, *args, f"hydra.run.dir={run_dir}")
    assert proc.returncode == expect, proc.stderr[-3000:]
    return read_summary(run_dir)


def export(run_dir, out) -> dict:
    proc = run_cli("export", str(run_dir), str(out), module="zerotune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = re.search(r"^\{$.*^\}$", proc.stdout, re.MULTILINE | re.DOTALL)  # after DeepSpeed's own lines
    assert answer, proc.stdout[-3000:]
    return json.loads(answer.group(0))


def assert_same(exported: dict, live: dict) -> None:
    assert exported.keys() == live.keys() and exported
    for name, weight in exported.items():
        assert torch.equal(weight, live[name]), name


def final_step_dir(run_dir, step: int = STEPS):
    return checkpoints.step_dir(run_dir / "checkpoints", step)


def assert_final_of_last_step(run_dir, summary: dict, written: dict) -> None:
    final = final_step_dir(run_dir)
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    assert summary["checkpoint"]["final"] == str(final) == summary["checkpoint"]["last_complete"]
    assert [c["step"] for c in summary["checkpoint"]["saved"]] == [STEPS]
    assert written["checkpoint"] == str(final)
    assert checkpoints.read_meta(final)["step"] == STEPS
    assert (run_dir / "checkpoints" / checkpoints.LATEST).read_text().strip() == final.name
    assert checkpoints.problems(final) == []
    ema = torch.load(final / checkpoints.EMA_FILE, weights_only=True)
    assert ema["updates"] == STEPS, "the live copy was taken after the last step"


def check_exports_its_last_step(run_dir, summary: dict, out) -> None:
    written = export(run_dir, out)
    assert_final_of_last_step(run_dir, summary, written)
    assert_same(load_file(str(out / "unet.safetensors")), load_file(str(out / "unet_ema.safetensors")))


def test_a_default_run_exports_its_last_step_with_no_flag(default_job_run, tmp_path):
    check_exports_its_last_step(*default_job_run, tmp_path / "out")


@pytest.mark.slow  # ZeRO-2 in the default suite: test_a_default_run_exports_its_last_step_with_no_flag
def test_a_zero3_run_exports_its_last_step_with_no_flag(tmp_path):
    run_dir = tmp_path / "run"
    summary = train(run_dir, f"train.max_steps={STEPS}", "zero_stage=3", *LIVE_COPY)
    check_exports_its_last_step(run_dir, summary, tmp_path / "out")


@pytest.mark.slow
def test_a_lora_run_exports_its_last_step_with_no_flag(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    summary = train(run_dir, f"train.max_steps={STEPS}", "adapter=lora", *LIVE_COPY)
    written = export(run_dir, out)
    assert_final_of_last_step(run_dir, summary, written)
    adapter = load_file(written["lora"])
    assert adapter and all(".lora_" in k for k in adapter)
    assert_same(adapter, load_file(written["lora_ema"]))


@pytest.mark.slow
def test_final_false_leaves_no_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    summary = train(run_dir, "train.max_steps=2", "checkpoint.final=false")
    assert summary["status"] == "ok" and summary["steps"] == 2
    assert summary["checkpoint"]["saved"] == [] and summary["checkpoint"]["final"] is None
    assert not (run_dir / "checkpoints").exists(), "nothing saved, no folder"
    proc = run_cli("export", str(run_dir), str(tmp_path / "out"), module="zerotune")
    assert proc.returncode != 0 and "not a complete checkpoint" in proc.stderr
    assert "checkpoint.final=false" in proc.stderr, "the error says why the run left none"


@pytest.mark.slow
def test_a_failed_run_writes_no_final_checkpoint(tmp_path):
    """A failed run's state may be what broke it, and a save is a collective that a failed rank cannot join."""
    run_dir = tmp_path / "run"
    summary = train(run_dir, "train.max_steps=4", "debug.fail_at_step=3", expect=1)
    assert summary["status"] == "failed" and summary["steps"] == 3
    assert summary["checkpoint"]["final"] is None and summary["checkpoint"]["last_complete"] is None
    assert checkpoints.list_complete(run_dir / "checkpoints") == []


@pytest.mark.slow
def test_a_periodic_save_of_the_last_step_is_the_final_one_and_resuming_there_rewrites_nothing(tmp_path):
    run_dir = tmp_path / "run"
    summary = train(run_dir, "train.max_steps=4", "checkpoint.every_n_steps=2")
    final = final_step_dir(run_dir, 4)
    assert [c["step"] for c in summary["checkpoint"]["saved"]] == [2, 4], "step 4 is saved once"
    assert summary["checkpoint"]["final"] == str(final)
    sealed = (final / checkpoints.COMPLETE).stat().st_mtime_ns

    # The same run continued in place with nothing left to train: its last checkpoint is the final one.
    summary = train(run_dir, "train.max_steps=4", "checkpoint.every_n_steps=2", "resume=latest")
    assert summary["status"] == "ok" and summary["checkpoint"]["resumed_from"]["step"] == 4
    assert summary["checkpoint"]["saved"] == [] and summary["checkpoint"]["final"] == str(final)
    assert (final / checkpoints.COMPLETE).stat().st_mtime_ns == sealed


def fake_checkpoint(root, step: int):
    """A complete checkpoint as far as finding and cleaning up go (COMPLETE as before manifests)."""
    folder = checkpoints.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / checkpoints.META).write_text(json.dumps({"step": step}))
    (folder / checkpoints.COMPLETE).write_text(f"{step}\n")
    return folder


def test_keep_last_never_deletes_the_save_just_made(tmp_path):
    """A checkpoint dir holding later steps of an earlier run: this run's final step is not among the newest."""
    for step in (100, 200, 300):
        fake_checkpoint(tmp_path, step)
    final = fake_checkpoint(tmp_path, 20)
    cleanup(tmp_path, keep_last=2, keep=final)
    assert [p.name for p in checkpoints.list_complete(tmp_path)] == ["step-0000020", "step-0000200", "step-0000300"]
    cleanup(tmp_path, keep_last=2)
    assert [p.name for p in checkpoints.list_complete(tmp_path)] == ["step-0000200", "step-0000300"]


def test_export_of_a_run_dir_follows_its_summary_to_a_checkpoint_dir_elsewhere(tmp_path):
    shared, run_dir = tmp_path / "ckpts", tmp_path / "run"
    ours, newer = fake_checkpoint(shared, 20), fake_checkpoint(shared, 900)  # 900: another run's, in the same dir
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "checkpoint": {
        "saved": [{"step": 20, "path": str(ours)}], "final": str(ours), "last_complete": str(newer)}}))
    assert find_checkpoint(run_dir) == ours
    shutil.rmtree(ours)
    with pytest.raises(SystemExit, match=f"its run's checkpoint {ours} is no longer complete"):
        find_checkpoint(run_dir)


@pytest.mark.parametrize("experiment", ["stage_resolution_batch", "stage_resolution_batch_cpu", "sdxl_4090_1024_bs8",
                                        "sdxl_4090_128_bs8", "sdxl_1024_bs1_8gib"])
def test_measuring_experiments_turn_the_final_checkpoint_off(experiment):
    assert compose_cfg(f"experiment={experiment}").checkpoint.final is False
    assert compose_cfg().checkpoint.final is True


def test_a_sweep_of_a_measuring_experiment_takes_no_checkpoint_lock(tmp_path):
    cfg = compose_cfg("experiment=stage_resolution_batch_cpu")
    with resume.job_lock(cfg.checkpoint, tmp_path):
        assert not (tmp_path / "checkpoints").exists()
    with resume.job_lock(compose_cfg().checkpoint, tmp_path):
        assert (tmp_path / "checkpoints" / ".zerotune.lock").exists()

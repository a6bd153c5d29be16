"""Checkpoints: exact resume, crash safety, stale NVMe swap, resuming across DeepSpeed changes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.helpers.cli import ROOT, cli_env, read_summary, run_cli
from zerotune.config.errors import ConfigError
from zerotune.rundir import checkpoints, resume
from zerotune.rundir.checkpoint_io import clean_stale_swap, cleanup

QUICK = ["train.batch_size=4", "train.log_every=1", "evaluate.enabled=false", "scheduler=warmup",
         "scheduler.warmup_steps=2",
         "precision=fp32"]


def losses_by_step(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/train"] for r in rows}


def train_ok(tmp, *args):
    proc = run_cli(*QUICK, *args, f"hydra.run.dir={tmp}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp)
    assert summary["status"] == "ok", summary.get("error")
    return summary


def exported(checkpoint, out) -> dict:
    proc = run_cli("export", str(checkpoint), str(out), module="zerotune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "unet.safetensors"))


def fake_checkpoint(root, step, complete=True):
    folder = checkpoints.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / checkpoints.META).write_text(json.dumps({"step": step}))
    if complete:
        (folder / checkpoints.COMPLETE).write_text(f"{step}\n")  # as checkpoints before manifests have it
    return folder


def resume_cfg(path, strict=False):
    return OmegaConf.create({"path": path, "strict": strict})


# ---------------------------------------------------------------- fast: rules, no training


def test_latest_ignores_interrupted_saves(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, complete=False)        # killed before COMPLETE was written
    (tmp_path / ".tmp-step-0000008-abc").mkdir()         # killed before the rename
    assert checkpoints.latest(tmp_path) == checkpoints.step_dir(tmp_path, 4)
    cleanup(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000004"]


def test_resume_rules(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints", 3)
    fake_checkpoint(run / "checkpoints", 5)
    resolve, step = checkpoints.resolve_resume, checkpoints.step_dir
    other = tmp_path / "new_run"
    assert resolve(resume_cfg(str(run)), None, other) == step(run / "checkpoints", 5)
    assert resolve(resume_cfg(str(run / "checkpoints" / "step-0000003")), None, other) == step(run / "checkpoints", 3)
    assert resolve(resume_cfg("latest"), str(run / "checkpoints"), other) == step(run / "checkpoints", 5)
    assert resolve(resume_cfg("latest"), None, run) == step(run / "checkpoints", 5)  # in place: the run's own
    assert resolve(resume_cfg(None), None, other) is None
    with pytest.raises(ConfigError) as err:
        resolve(resume_cfg("latest"), None, other)  # a new run dir has no checkpoints yet
    assert err.value.key == "resume.path" and "hydra.run.dir=<old run dir>" in err.value.fix
    with pytest.raises(ConfigError):
        resolve(resume_cfg(str(tmp_path / "nothing")), None, other)


@pytest.mark.parametrize(("saved", "now", "mode"), [
    ({"zero_stage": 1, "use_deepspeed": True}, {"zero_stage": 3, "use_deepspeed": True}, "universal"),
    ({"zero_stage": 3, "use_deepspeed": True}, {"zero_stage": 0, "use_deepspeed": False}, "full"),
    ({"zero_stage": 0, "use_deepspeed": False}, {"zero_stage": 0, "use_deepspeed": True}, "full"),
    ({"zero_stage": 0, "use_deepspeed": False}, {"zero_stage": 2, "use_deepspeed": True}, ConfigError),
    ({"zero_stage": 2, "use_deepspeed": True, "offload": "nvme"}, {"zero_stage": 3, "use_deepspeed": True},
     ConfigError),
    ({"zero_stage": 3, "use_deepspeed": True}, {"zero_stage": 2, "use_deepspeed": True}, ConfigError),
    ({"zero_stage": 3, "use_deepspeed": True, "world_size": 2}, {"zero_stage": 3, "use_deepspeed": True}, "universal"),
])
def test_conversion_choice(tmp_path, saved, now, mode):
    base = {"offload": "none", "optimizer": "AdamW", "world_size": 1}
    if mode is ConfigError:
        with pytest.raises(ConfigError) as err:
            resume.conversion_mode(tmp_path, {**base, **saved}, {**base, **now})
        assert "zerotune export" in err.value.fix
    else:
        assert resume.conversion_mode(tmp_path, {**base, **saved}, {**base, **now}) == mode


def test_stale_swap_removed_only_inside_offload_root(tmp_path):
    root, outside = tmp_path / "swap", tmp_path / "outside"
    (root / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    (root / "zero_stage_3" / "optimizer" / "rank0" / "stale.tensor.swp").write_bytes(b"x" * 64)
    (outside / "zero_stage_3").mkdir(parents=True)
    (outside / "keep.txt").write_text("keep")
    (outside / "zero_stage_3" / "keep.swp").write_text("keep")
    (root / "zero_stage_1").symlink_to(outside / "zero_stage_3")      # a swap-named link pointing outside
    (root / "zero_stage_3" / "link_out").symlink_to(outside)           # a link inside a swap folder
    (root / "my_notes.txt").write_text("not DeepSpeed's")
    removed = clean_stale_swap(root)
    assert sorted(removed) == [str(root / "zero_stage_1"), str(root / "zero_stage_3")]
    assert not (root / "zero_stage_3").exists() and not (root / "zero_stage_1").is_symlink()
    assert (root / "my_notes.txt").read_text() == "not DeepSpeed's"
    assert (outside / "keep.txt").read_text() == "keep"
    assert (outside / "zero_stage_3" / "keep.swp").read_text() == "keep"
    assert clean_stale_swap(tmp_path / "missing") == []


def test_the_lock_removes_the_run_dirs_checkpoints_folder_when_nothing_was_saved_there(tmp_path):
    run = tmp_path / "run"
    own, named = run / "checkpoints", tmp_path / "named"
    with resume.CheckpointDirLock(own, run):
        assert (own / ".zerotune.lock").is_file()
    assert not own.exists(), "a job that saved nothing leaves no checkpoints/ in its run dir"
    with resume.CheckpointDirLock(own, run):
        fake_checkpoint(own, 2)
    assert [p.name for p in checkpoints.list_complete(own)] == ["step-0000002"]
    with resume.CheckpointDirLock(named, run):
        pass
    assert named.is_dir(), "a checkpoint.dir the user named stays"


def test_resume_from_a_bad_path_is_a_config_error(tmp_path):
    proc = run_cli(*QUICK, "train.max_steps=2", f"resume={tmp_path / 'nope'}", f"hydra.run.dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    summary = read_summary(tmp_path / "r")
    assert summary["error"]["type"] == "ConfigError" and summary["error"]["key"] == "resume.path"
    # Found by the job's checks: its workers were turned away at the gate, before training.
    assert not (tmp_path / "r" / "metrics.jsonl").exists() and not (tmp_path / "r" / "ranks").exists()
    assert proc.stderr.count("is not a complete checkpoint") == 1


# ---------------------------------------------------------------- slow: real training


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    """4 steps straight == 2 steps, resume, 2 more: same losses, same final weights and EMA (fp32, CPU)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["zero_stage=2", "train.max_steps=4", "checkpoint.every_n_steps=2", "ema.enabled=true"]
    summary = train_ok(straight, *args)
    saved = summary["checkpoint"]["saved"]
    assert [c["step"] for c in saved] == [2, 4] and all(c["bytes"] > 0 for c in saved)
    meta = checkpoints.read_meta(straight / "checkpoints" / "step-0000002")
    assert meta["zero_stage"] == 2 and meta["world_size"] == 1 and meta["use_deepspeed"] is True
    assert meta["precision"] == "fp32" and meta["offload"] == "none" and meta["model"] == "tiny"
    summary = train_ok(resumed, *args, f"resume={straight / 'checkpoints' / 'step-0000002'}")
    assert summary["checkpoint"]["resumed_from"]["mode"] == "native"
    a, b = losses_by_step(straight), losses_by_step(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert b[step] == pytest.approx(a[step], rel=1e-6)
    wa = exported(straight / "checkpoints" / "step-0000004", tmp_path / "ea")
    wb = exported(resumed, tmp_path / "eb")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] - wb[k]).abs().max().item() <= 1e-6 * (1 + wa[k].abs().max().item()), k
    ea, eb = load_file(str(tmp_path / "ea" / "unet_ema.safetensors")), load_file(str(tmp_path / "eb" /
                                                                                    "unet_ema.safetensors"))
    assert all((ea[k] - eb[k]).abs().max().item() <= 1e-6 for k in ea)


@pytest.mark.slow
def test_kill_9_loses_nothing_before_the_last_checkpoint(tmp_path):
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    cmd = [sys.executable, str(ROOT / "train.py"), *QUICK, "zero_stage=1", "train.max_steps=200",
           "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", f"hydra.run.dir={killed}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 400
        while checkpoints.latest(killed / "checkpoints") is None or checkpoints.latest(killed / "checkpoints").name < \
                "step-0000004":
            assert proc.poll() is None and time.time() < deadline, "no checkpoint written"
            time.sleep(0.2)
        time.sleep(1.0)  # likely mid-step or mid-save: any moment must do
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    last = checkpoints.latest(killed / "checkpoints")
    step = checkpoints.read_meta(last)["step"]
    before = losses_by_step(killed)
    summary = train_ok(resumed, "zero_stage=1", f"train.max_steps={step + 2}", "checkpoint.every_n_steps=2",
                       "resume=latest", f"checkpoint.dir={killed / 'checkpoints'}")
    assert summary["checkpoint"]["resumed_from"]["step"] == step
    after = losses_by_step(resumed)
    assert min(after) == step + 1, "the resumed run starts right after the last checkpoint"
    assert all(s in before for s in range(1, step + 1)), "every step up to the checkpoint was logged"
    for s in after:
        if s in before:  # the killed run got past the checkpoint: the replay matches it
            assert after[s] == pytest.approx(before[s], rel=1e-6)
    assert checkpoints.latest(killed / "checkpoints").name == f"step-{step + 2:07d}"


@pytest.mark.slow
def test_resume_across_stages_keeps_optimizer_state(tmp_path):
    """Stage 1 -> 2 -> 3 (DeepSpeed universal checkpoint) -> 0 without DeepSpeed (own conversion)."""
    ref = tmp_path / "s1"
    train_ok(ref, "zero_stage=1", "train.max_steps=8", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0")
    expected = losses_by_step(ref)
    source = ref / "checkpoints" / "step-0000002"
    for stage, until, extra in ((2, 4, []), (3, 6, []), (0, 8, ["deepspeed.enabled=false"])):
        run = tmp_path / f"s{stage}"
        summary = train_ok(run, f"zero_stage={stage}", *extra, f"train.max_steps={until}",
                           "checkpoint.every_n_steps=2", f"resume={source}")
        assert summary["checkpoint"]["resumed_from"]["mode"] == ("full" if stage == 0 else "universal")
        got = losses_by_step(run)
        assert sorted(got) == [until - 1, until]
        # A restarted Adam would take a first step of ~lr in every weight; these match the straight run.
        for s in got:
            assert got[s] == pytest.approx(expected[s], rel=1e-4), (stage, s, got[s], expected[s])
        source = run / "checkpoints" / f"step-{until:07d}"
    final, straight = exported(source, tmp_path / "e0"), exported(ref, tmp_path / "eref")
    for k in straight:
        assert (final[k] - straight[k]).abs().max().item() < 1e-4, k

"""A lock a killed JIT build left in the torch extensions cache never makes a job wait forever
(host/ops_locks.py, and host/ops.py before each op load): provably stale ones are removed with a warning,
live ones are waited on for a bounded time, undecided ones stop the job naming the file."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from torch.utils.file_baton import FileBaton

from tests.helpers.built_ops import ADAM_CPU_OFFLOAD, OFFLOAD_CPU_OPS, is_current
from tests.helpers.cli import ROOT, cli_env, read_summary, run_cli
from zerotune.host import ops
from zerotune.host import ops_locks as ext_lock


@pytest.fixture
def tex(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "torch_extensions"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def plant(root: Path, op: str) -> Path:
    """What SIGKILL during a build leaves: the op's folder with its lock file, open nowhere."""
    (root / op).mkdir(parents=True, exist_ok=True)
    lock = root / op / "lock"
    lock.touch()
    return lock


def hold(lock: Path, release_after_s: float = 120) -> subprocess.Popen:
    """A live process holding `lock` exactly as torch's JIT build does (FileBaton.try_acquire keeps the fd
    open), which releases it (closes, then removes the file) after `release_after_s`."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    code = ("import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
            "baton = FileBaton(sys.argv[1])\nassert baton.try_acquire()\nprint('held', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\nbaton.release()")
    child = subprocess.Popen([sys.executable, "-c", code, str(lock), str(release_after_s)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_the_root_is_torchs(tex, monkeypatch):
    assert ext_lock.extensions_root() == tex
    assert ext_lock.lock_path("cpu_adam") == tex / "cpu_adam" / "lock"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    flavour = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{flavour}"
    assert ext_lock.extensions_root() == Path(get_default_build_root()) / tag


def test_a_stale_lock_is_found_and_removed_within_seconds(tex, caplog):
    lock = plant(tex, "cpu_adam")
    (tex / "async_io").mkdir()  # an op folder without a lock
    assert ext_lock.find_locks() == [lock]
    [state] = ext_lock.inspect([lock])
    assert state.state == "stale" and state.pids == []
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="zerotune"):
        settled = ext_lock.settle(lock, timeout_s=600)
    assert settled.state == "removed" and not lock.exists()
    assert time.monotonic() - start < 60  # not the 600 s wait
    assert str(lock) in caplog.text and "stale" in caplog.text


def test_a_lock_held_by_a_live_process_is_reported_not_removed(tex):
    lock = ext_lock.lock_path("cpu_adam")
    child = hold(lock)
    try:
        [state] = ext_lock.inspect(ext_lock.find_locks())
        assert state.state == "held" and state.pids == [child.pid]
        assert str(lock) in state.describe() and f"pid {child.pid}" in state.describe()
        start = time.monotonic()
        assert ext_lock.settle(lock, timeout_s=1.0, poll_s=0.2).state == "held"  # bounded: gives up after 1 s
        assert 1.0 <= time.monotonic() - start < 60 and lock.exists()
    finally:
        child.send_signal(signal.SIGKILL)  # the build killed mid-way: its lock stays behind
        child.wait()
    assert lock.exists()
    assert ext_lock.settle(lock, timeout_s=600).state == "removed" and not lock.exists()


def test_a_wait_ends_when_the_holder_finishes(tex):
    lock = ext_lock.lock_path("cpu_adam")
    child = hold(lock, release_after_s=1.0)
    start = time.monotonic()
    state = ext_lock.settle(lock, timeout_s=60, poll_s=0.2)
    assert child.wait(timeout=30) == 0
    assert state.state == "gone" and 0.5 < time.monotonic() - start < 50


def test_the_job_stops_naming_the_holder_after_the_bounded_wait(tex, monkeypatch):
    lock = ext_lock.lock_path("cpu_adam")
    child = hold(lock)
    monkeypatch.setenv(ops.LOCK_WAIT_ENV, "1")
    try:
        with pytest.raises(ops.OpBuildError) as info:
            ops.clear_lock("cpu_adam")
    finally:
        child.kill()
        child.wait()
    err = info.value
    assert str(lock) in err.problem and f"pid {child.pid}" in err.problem and "after 1 s" in err.problem
    assert f"kill {child.pid}" in err.fix


@pytest.mark.parametrize("why", ["uninspectable", "network"])
def test_an_undecided_lock_is_kept_and_named_with_its_fix(tex, monkeypatch, why):
    lock = plant(tex, "cpu_adam")
    if why == "uninspectable":  # a process of the lock's owner whose descriptors cannot be read
        real_scan = ext_lock._scan
        monkeypatch.setattr(ext_lock, "_scan", lambda wanted: (real_scan(wanted)[0], {4242: os.getuid()}))
        expected = "4242 could not be inspected"
    else:
        monkeypatch.setattr(ext_lock, "fs_type", lambda path: "nfs4")
        expected = "nfs4 file system"
    [state] = ext_lock.inspect([lock])
    assert state.state == "undecided" and expected in state.reason
    start = time.monotonic()
    with pytest.raises(ops.OpBuildError) as info:
        ops.clear_lock("cpu_adam")
    assert time.monotonic() - start < 60  # undecided: told at once, not after the lock wait
    assert lock.exists()
    err = info.value
    assert err.key == "TORCH_EXTENSIONS_DIR" and str(lock) in err.problem and expected in err.problem
    assert "safe to delete when no DeepSpeed op build is running" in err.fix and f"rm {lock}" in err.fix


def test_other_users_processes_cannot_hold_it(tex, monkeypatch):
    """Its holder created it, so runs as its owner: a hidden process of another user changes nothing."""
    lock = plant(tex, "cpu_adam")
    real_scan = ext_lock._scan
    monkeypatch.setattr(ext_lock, "_scan", lambda wanted: (real_scan(wanted)[0], {4242: os.getuid() + 1}))
    assert ext_lock.inspect([lock])[0].state == "stale"


def test_prebuild_clears_the_lock_before_torchs_loader_takes_it(tex, monkeypatch, caplog):
    """prebuild_ops on an offload=cpu config, with a stale lock on cpu_adam: the load that follows takes
    torch's own FileBaton at once (it would spin forever on the stale file)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    lock = plant(tex, "cpu_adam")
    loads = []

    def load_like_torch(self, verbose=False):
        ext_lock.lock_path(self.name).parent.mkdir(exist_ok=True)  # as torch's _get_build_directory does
        baton = FileBaton(str(ext_lock.lock_path(self.name)))
        assert baton.try_acquire(), f"torch's loader would wait on {ext_lock.lock_path(self.name)}"
        baton.release()
        loads.append(self.name)
        return types.SimpleNamespace(__file__=None)

    monkeypatch.setattr(OpBuilder, "load", load_like_torch)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="zerotune"):
        record = ops.prebuild_ops(ADAM_CPU_OFFLOAD, use_deepspeed=True)
    assert time.monotonic() - start < 300  # not the 600 s wait
    assert loads == OFFLOAD_CPU_OPS and [op["name"] for op in record["ops"]] == OFFLOAD_CPU_OPS
    assert not lock.exists() and f"removed the stale torch extensions lock {lock}" in caplog.text


def copy_built_ops(built: Path, root: Path, op_names: list[str]) -> None:
    """Copy the session's built ops (conftest's built_offload_ops): loading the copy compiles nothing."""
    for op in op_names:
        shutil.copytree(built / op, root / op, ignore=shutil.ignore_patterns("lock"))  # copy2 keeps mtimes
        assert is_current(root / op), f"the copy of {built / op} would be rebuilt"


def test_a_real_prebuild_is_not_stuck_on_a_stale_lock(tmp_path, built_offload_ops):
    """The real DeepSpeed loaders, on a copy of the built cache with a stale lock planted on cpu_adam."""
    root = tmp_path / "torch_extensions"
    copy_built_ops(built_offload_ops, root, OFFLOAD_CPU_OPS)
    lock = plant(root, "cpu_adam")
    code = ("import json, logging, sys\nlogging.basicConfig(level=logging.INFO)\n"
            "from zerotune.host.ops import prebuild_ops\n"
            f"print(json.dumps(prebuild_ops({ADAM_CPU_OFFLOAD!r}, True)))")
    # A stuck load waits on the lock forever, so the timeout is the check; no wall-time bound (shared machines).
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**cli_env(), "TORCH_EXTENSIONS_DIR": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removed the stale torch extensions lock {lock}" in proc.stderr
    assert not lock.exists() and (root / "cpu_adam" / "cpu_adam.so").is_file()


@pytest.mark.slow
def test_a_job_starts_despite_a_stale_lock(tmp_path, built_offload_ops):
    """`train.py ... offload=cpu` with a stale lock on cpu_adam: the job runs to the end and says which file
    it removed."""
    root = tmp_path / "torch_extensions"
    copy_built_ops(built_offload_ops, root, OFFLOAD_CPU_OPS)
    lock = plant(root, "cpu_adam")
    run_dir = tmp_path / "job"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)  # run_cli's env copies os.environ
    try:
        proc = run_cli("train.max_steps=1", "zero_stage=2", "offload=cpu", "evaluate.enabled=false",
                       f"hydra.run.dir={run_dir}", timeout=300)
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removed the stale torch extensions lock {lock}" in proc.stdout + proc.stderr
    assert not lock.exists()
    summary = read_summary(run_dir)
    assert {op["name"] for op in summary["ops_build"]["ops"]} == set(OFFLOAD_CPU_OPS)

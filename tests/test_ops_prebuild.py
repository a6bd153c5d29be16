"""DeepSpeed's JIT ops are built by the job's parent, before its memory sampler starts (host/ops.py): which
ops a run needs, what a failed build says, and a real job's record of the build."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.cli import ROOT, cli_env, compose_cfg, preflight, read_summary, run_cli
from zerotune.config.errors import ConfigError
from zerotune.host import ops
from zerotune.job.gate import Gate, GateWatch

SHM = "ShareMemCommBuilder"


@pytest.mark.parametrize(("overrides", "expected"), [
    # No offload: torch's AdamW (deepspeed.torch_adam=auto), so no optimizer op; only the comm op.
    (("zero_stage=2", "offload=none"), [SHM]),
    (("zero_stage=1", "offload=none", "optimizer=adagrad"), [SHM]),
    (("zero_stage=2", "offload=cpu"), [SHM, "CPUAdamBuilder"]),
    (("zero_stage=2", "offload=cpu", "optimizer=adagrad"), [SHM, "CPUAdagradBuilder"]),
    (("zero_stage=2", "offload=cpu", "optimizer=lion"), [SHM, "CPULionBuilder"]),
    (("zero_stage=3", "offload=nvme"), [SHM, "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder"]),
    (("zero_stage=0", "deepspeed.enabled=false"), []),
])
def test_ops_a_composed_run_needs(overrides, expected, tmp_path, monkeypatch):
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    checked = preflight(compose_cfg(*overrides, f"offload.path={tmp_path}"))
    assert ops.needed_ops(checked.ds_config, checked.use_deepspeed) == expected


def test_ops_from_hand_written_dicts(monkeypatch):
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    cpu = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ops.needed_ops({**cpu, "optimizer": {"type": "ADAMW", "params": {}}}, True) == [SHM, "CPUAdamBuilder"]
    # torch_adam wins over the offload: the engine builds torch.optim.AdamW.
    assert ops.needed_ops({**cpu, "optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, True) == [SHM]
    # Not offloaded and not torch_adam: DeepSpeed's fused kernel.
    assert ops.needed_ops({"optimizer": {"type": "AdamW", "params": {}}}, True) == [SHM, "FusedAdamBuilder"]
    assert ops.needed_ops({"optimizer": {"type": "Lion"}}, True) == [SHM, "FusedLionBuilder"]
    assert ops.needed_ops({**cpu}, True) == [SHM]  # no optimizer block: the client's own optimizer
    assert ops.needed_ops({**cpu, "optimizer": {"type": "AdamW"}}, False) == []
    # Parameters on NVMe alone still swap through async_io.
    nvme_params = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert ops.needed_ops(nvme_params, True) == [SHM, "PinMemoryBuilder", "AsyncIOBuilder"]
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    assert ops.needed_ops(cpu, True) == [SHM, "PinMemoryBuilder"]


def test_no_deepspeed_builds_nothing():
    record = ops.prebuild_ops({"optimizer": {"type": "AdamW"}}, use_deepspeed=False)
    assert record == {"ops": [], "skipped": [], "total_seconds": 0.0, "host_peak_mib": None}


class _FailingBuilder:
    NAME = "async_io"

    def load(self):
        raise RuntimeError("Error building extension 'async_io':\n[1/2] c++ ...\n"
                           "deepspeed_aio_common.cpp:19:10: fatal error: libaio.h: No such file or directory")


def test_a_failed_build_names_the_op_and_the_fix():
    with pytest.raises(ConfigError) as info:
        ops.load_op("AsyncIOBuilder", _FailingBuilder())
    err = info.value
    assert isinstance(err, ops.OpBuildError) and err.key == "offload.device"
    assert "async_io" in err.problem and "libaio.h: No such file" in err.problem
    assert "libaio-dev" in err.fix
    assert isinstance(err.__cause__, RuntimeError)  # the compiler's error stays attached


def test_a_real_failed_compile_raises(tmp_path):
    """No working compiler (CXX=false) and an empty cache: the first op DeepSpeed would JIT-build fails
    here, loudly, before any worker starts."""
    env = {**cli_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false"}
    code = ("from zerotune.host.ops import prebuild_ops\n"
            "prebuild_ops({'zero_optimization': {'stage': 2, 'offload_optimizer': {'device': 'cpu'}},"
            " 'optimizer': {'type': 'AdamW', 'params': {}}}, True)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "OpBuildError" in proc.stderr and "deepspeed_shm_comm op" in proc.stderr, proc.stderr[-2000:]
    assert "install a C++ compiler" in proc.stderr


@pytest.fixture(scope="module")
def cold_job(tmp_path_factory):
    """A real offload=cpu job, through the CLI, with an empty torch extensions cache."""
    tex = tmp_path_factory.mktemp("torch_extensions")
    run_dir = tmp_path_factory.mktemp("job")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tex)  # run_cli's env copies os.environ
    try:
        proc = run_cli("zero_stage=2", "offload=cpu", "train.max_steps=2", "evaluate.enabled=false",
                       f"hydra.run.dir={run_dir}")
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_summary(run_dir), tex, run_dir


@pytest.mark.slow
def test_a_cold_job_records_its_op_builds(cold_job):
    summary, tex, run_dir = cold_job
    built = {op["name"]: op for op in summary["ops_build"]["ops"]}
    assert set(built) == {"deepspeed_shm_comm", "cpu_adam"}
    adam = built["cpu_adam"]
    assert adam["builder"] == "CPUAdamBuilder" and adam["was_cached"] is False
    assert adam["path"].startswith(str(tex)) and os.path.exists(adam["path"])
    assert adam["seconds"] > 1.0  # a real compile, not a cache hit
    # The parent (hundreds of MiB with torch) plus the compiler it ran.
    assert adam["host_peak_mib"] > 200
    assert summary["ops_build"]["total_seconds"] >= sum(op["seconds"] for op in built.values())
    assert summary["ops_build"]["host_peak_mib"] == max(op["host_peak_mib"] for op in built.values())
    # The worker found both ops built: no .so was (re)written after the job's gate let it train.
    assert all(os.path.getmtime(op["path"]) < summary["startup_marks"]["gate_open"] for op in built.values())
    # The wait on the build is reported apart, not as the run's start-up.
    assert summary["startup"]["ops_build_s"] > 1.0 and summary["perf"]["startup_s"] < summary["startup"]["to_first_step_s"]


@pytest.mark.slow
def test_a_build_in_a_child_process_finds_the_cache(cold_job, monkeypatch):
    """The path used for ops that need a GPU toolchain: a spawned child loads the op; here it is cached."""
    _, tex, _ = cold_job
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tex))
    one = ops._build_isolated("CPUAdamBuilder")
    assert one["name"] == "cpu_adam" and one["was_cached"] is True
    assert one["path"].startswith(str(tex))
    assert one["host_peak_mib"] > 50  # a python with torch imported, sampled while it loaded the op



def _prebuild_with_fake_loads(monkeypatch, tmp_path) -> list[str]:
    """prebuild_ops for an offload=cpu dict, the loads faked; what happened, in order."""
    events: list[str] = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "clear_lock", lambda op: None)
    monkeypatch.setattr(ops, "_build_here", lambda name, builder: events.append(f"load {builder.NAME}") or {
        "name": builder.NAME, "builder": name, "seconds": 0.0, "was_cached": True, "path": None, "host_peak_mib": 1.0})
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW"}}
    ops.prebuild_ops(ds, use_deepspeed=True, before_compiling=lambda: events.append("wait for the workers"))
    return events


def test_a_cold_build_waits_for_the_workers_imports_once(monkeypatch, tmp_path):
    events = _prebuild_with_fake_loads(monkeypatch, tmp_path)
    assert events[0] == "wait for the workers" and events.count("wait for the workers") == 1
    assert "load cpu_adam" in events
    for op in ("cpu_adam", "deepspeed_shm_comm"):  # both in the cache now: nothing to wait for
        (tmp_path / op).mkdir()
        (tmp_path / op / f"{op}.so").write_bytes(b"")
    assert ops.is_cached("cpu_adam")
    assert "wait for the workers" not in _prebuild_with_fake_loads(monkeypatch, tmp_path)


def test_the_gate_counts_the_workers_waiting_at_it(tmp_path):
    gate = Gate(tmp_path)
    watches = [GateWatch(tmp_path, gate.token) for _ in range(2)]
    assert gate.wait_for_arrivals(2, timeout_s=0.2) == 0  # none has finished importing: the wait is bounded
    ready = threading.Thread(target=watches[0].wait_for_go)
    ready.start()
    deadline = time.monotonic() + 5
    while not list(tmp_path.glob(".gate-*.arrived.*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.wait_for_arrivals(1, timeout_s=5) == 1
    gate.workers_gone.set()  # the launcher returned: nobody else will come
    started = time.monotonic()
    assert gate.wait_for_arrivals(2, timeout_s=30) == 1 and time.monotonic() - started < 1
    gate.decide("go")
    ready.join(5)
    assert not ready.is_alive()
    gate.remove()
    assert list(tmp_path.iterdir()) == []  # the decision and the arrivals go with the job


def test_setup_builds_the_cpu_ops_a_job_loads(built_offload_ops):
    """`python -m zerotune.host.ops`, which `make setup` runs: here the ops are built already, so it loads them."""
    proc = subprocess.run([sys.executable, "-m", "zerotune.host.ops"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**cli_env(), "TORCH_EXTENSIONS_DIR": str(built_offload_ops)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "deepspeed_shm_comm, cpu_adam ready" in proc.stdout

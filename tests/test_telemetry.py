"""Telemetry: memory peaks (host tree, NVMe dir, GPU-or-None), step timing, plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types

import numpy as np
import psutil
import pytest

from zerotune.host import memory
from zerotune.host.memory import MemorySampler
from zerotune.host.platform import environment_info
from zerotune.host.timing import StepTimer, process_start_time
from zerotune.host.torch_memory import pinned_memory_mib, plot_run, torch_cuda_memory_stats

MIB = 1 << 20
TOL = 0.15  # RSS also moves with allocator/interpreter noise of a few MiB
INTERVAL = 0.02
THREAD_NAME = "zerotune-memory-sampler"

# A leaf process allocates `mib` on request; with depth > 0 it first nests itself (child -> grandchild),
# sharing the pipes, so the allocation happens `depth` levels below the test's direct child.
ALLOC_SCRIPT = """
import subprocess, sys
mib, depth = int(sys.argv[1]), int(sys.argv[2])
if depth > 0:
    sys.exit(subprocess.call([sys.executable, __file__, str(mib), str(depth - 1)]))
import numpy as np
print("ready", flush=True)
sys.stdin.readline()
a = np.ones(mib * 2**20 // 8)
print("allocated", flush=True)
sys.stdin.readline()
"""


def wait_for_thread_samples(s: MemorySampler, k: int = 3, timeout_s: float = 10.0) -> None:
    """Lets the background thread (not sample_now) take k more samples; robust to a loaded machine."""
    target, deadline = s.stats()["samples"] + k, time.monotonic() + timeout_s
    while s.stats()["samples"] < target:
        assert time.monotonic() < deadline, "sampler thread is not sampling"
        time.sleep(INTERVAL / 2)


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture(autouse=True)
def no_leaked_sampler_threads():
    yield
    assert sampler_threads() == []


# ------------------------------------------------------------------ host / GPU fields
def test_cpu_only_gpu_fields_are_none_and_host_rss_plausible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no visible device, whatever the machine has
    with MemorySampler(interval_s=INTERVAL) as s:
        wait_for_thread_samples(s)
        current = s.sample_now()
    peaks = s.peaks()
    for d in (peaks, current):
        assert d["gpu_peak_process_mib"] is None and d["gpu_peak_device_mib"] is None
        assert d["nvme_peak_mib"] is None  # no nvme_dir given
    own_rss = psutil.Process().memory_info().rss / MIB
    assert own_rss * 0.9 <= peaks["host_peak_rss_mib"] <= 64 * 1024


def test_gpu_fields_none_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    s = MemorySampler()
    sample = s.sample_now()
    assert sample["gpu_peak_process_mib"] is None and sample["gpu_peak_device_mib"] is None
    assert sample["host_peak_rss_mib"] > 0


def fake_pynvml(processes: list[tuple[int, int | None]], device_used: int) -> types.SimpleNamespace:
    """Stands in for pynvml: records which handle was asked for, returns fixed memory figures."""
    nv = types.SimpleNamespace(handles=[], nvmlMemory_v2=0x02000028)
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: 4
    nv.nvmlDeviceGetHandleByIndex = lambda i: nv.handles.append(f"index:{i}") or "h"
    nv.nvmlDeviceGetHandleByUUID = lambda u: nv.handles.append(f"uuid:{u}") or "h"
    nv.nvmlDeviceGetMemoryInfo = lambda h, version=None: types.SimpleNamespace(used=device_used)
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes
    ]
    return nv


def test_gpu_process_memory_sums_only_our_tree(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stranger = 4_000_000  # above pid_max: never one of ours
        nv = fake_pynvml([(os.getpid(), 1024 * MIB), (child.pid, 512 * MIB), (stranger, 4096 * MIB)], 9000 * MIB)
        monkeypatch.setitem(sys.modules, "pynvml", nv)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        s = MemorySampler(cuda_index=1)
        assert nv.handles == ["index:1"]  # CUDA ordinal 1 is physical GPU 1 here
        sample = s.sample_now()
        assert sample["gpu_peak_process_mib"] == 1536.0  # ours + child, not the stranger
        assert sample["gpu_peak_device_mib"] == 9000.0
    finally:
        child.kill()
        child.wait()


def test_gpu_handle_by_uuid_and_unattributable_memory(monkeypatch):
    nv = fake_pynvml([(os.getpid(), None)], 100 * MIB)  # driver cannot attribute (NVML_VALUE_NOT_AVAILABLE)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    monkeypatch.setenv("LOCAL_RANK", "0")
    s = MemorySampler()
    assert nv.handles == ["uuid:GPU-abc"]
    assert s.sample_now()["gpu_peak_process_mib"] is None
    assert s.peaks()["gpu_peak_device_mib"] == 100.0


def test_gpu_no_context_is_zero_but_container_pid_mismatch_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([(4_000_000, 64 * MIB)], 64 * MIB))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = MemorySampler()
    s._container_pids = False  # same PID namespace as the driver: no match means no CUDA context
    assert s.sample_now()["gpu_peak_process_mib"] == 0.0
    s._container_pids = True  # own PID namespace: NVML's host PIDs cannot be matched, so unknown
    assert s.sample_now()["gpu_peak_process_mib"] is None


def test_environment_info_fields():
    info = environment_info()
    assert {"device_name", "gpu_total_mib", "driver_version", "torch", "deepspeed", "accelerate", "diffusers",
            "cuda_version", "python", "hostname", "cpu_count"} <= set(info)
    assert info["device_name"] and info["python"].count(".") == 2 and info["cpu_count"] >= 1
    torch = pytest.importorskip("torch")
    assert info["torch"] == torch.__version__
    assert info["cuda_version"] == torch.version.cuda  # the build's CUDA (13.0 on PyPI's default), None on a CPU build
    if not torch.cuda.is_available():
        assert info["gpu_total_mib"] is None and info["gpu_count"] == 0


@pytest.mark.parametrize(("metadata_version", "build"), [("2.13.0", "2.13.0+cu130"), ("2.13.0+cpu", "2.13.0+cpu")])
def test_the_environment_names_torchs_build_whatever_its_metadata_says(monkeypatch, metadata_version, build):
    """PyPI's CUDA build says 2.13.0 in its metadata and 2.13.0+cu130 itself; the CPU wheel says 2.13.0+cpu in
    both. The record names the build."""
    torch = pytest.importorskip("torch")
    from zerotune.host import platform

    real = platform.metadata.version
    monkeypatch.setattr(platform.metadata, "version", lambda dist: metadata_version if dist == "torch" else real(dist))
    monkeypatch.setattr(torch, "__version__", build)
    assert platform.environment_info()["torch"] == build


def test_torch_stats_none_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: values are measured, not None")
    assert set(torch_cuda_memory_stats().values()) == {None}
    assert pinned_memory_mib() is None


def test_allocation_in_sampled_process_shows_in_peak():
    mib = 300
    with MemorySampler(interval_s=INTERVAL) as s:
        base = s.sample_now()["host_peak_rss_mib"]
        buf = np.ones(mib * MIB // 8)  # np.ones writes every page, so all of it becomes resident
        wait_for_thread_samples(s)  # only the background thread samples while the buffer is alive
        del buf
        after = s.sample_now()["host_peak_rss_mib"]
    grew = s.peaks()["host_peak_rss_mib"] - base
    assert mib * (1 - TOL) <= grew <= mib * (1 + TOL)
    assert after < base + mib * TOL  # current fell back...
    assert s.peaks()["host_peak_rss_mib"] >= base + mib * (1 - TOL)  # ...the peak did not


def _run_alloc_child(tmp_path, mib: int, depth: int) -> subprocess.Popen:
    script = tmp_path / "alloc.py"
    script.write_text(ALLOC_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(mib), str(depth)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _step(proc: subprocess.Popen, expect: str | None) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    if expect is not None:
        assert proc.stdout.readline().strip() == expect


@pytest.mark.parametrize("proc_children_file", [True, False], ids=["proc-children", "psutil-fallback"])
def test_grandchild_allocation_shows_in_tree_peak(tmp_path, monkeypatch, proc_children_file):
    if not proc_children_file:  # kernels without CONFIG_PROC_CHILDREN take the psutil path
        monkeypatch.setattr(memory, "child_pids", lambda pid: None)
    mib = 200
    proc = _run_alloc_child(tmp_path, mib, depth=1)  # test -> child -> grandchild (allocates)
    try:
        with MemorySampler(interval_s=INTERVAL) as s:
            base = s.sample_now()["host_peak_rss_mib"]
            _step(proc, "allocated")
            wait_for_thread_samples(s)
            _step(proc, None)
            proc.wait(timeout=30)
            s.sample_now()
        grew = s.peaks()["host_peak_rss_mib"] - base
        assert mib * (1 - TOL) <= grew <= mib * (1 + TOL)
    finally:
        proc.kill()


def test_excluded_subtree_is_not_counted(tmp_path):
    mib = 200
    proc = _run_alloc_child(tmp_path, mib, depth=1)
    try:
        name = psutil.Process(proc.pid).name()  # excluding the child drops its grandchild too
        s = MemorySampler(interval_s=INTERVAL, exclude_names=(name,))
        base = s.sample_now()["host_peak_rss_mib"]
        _step(proc, "allocated")
        assert s.sample_now()["host_peak_rss_mib"] - base < mib * TOL
        _step(proc, None)
        proc.wait(timeout=30)
    finally:
        proc.kill()


# ------------------------------------------------------------------ NVMe directory
def test_nvme_dir_bytes_and_peak_survives_deletion(tmp_path):
    swap = tmp_path / "swap"
    (swap / "rank0").mkdir(parents=True)
    sizes = {swap / "a.swp": 10, swap / "b.swp": 7, swap / "rank0" / "c.swp": 3}  # MiB
    s = MemorySampler(nvme_dir=swap)
    assert s.sample_now()["nvme_peak_mib"] == 0.0
    for path, mib in sizes.items():
        path.write_bytes(b"\0" * (mib * MIB))
    assert s.sample_now()["nvme_peak_mib"] == pytest.approx(20.0)
    for path in sizes:
        path.unlink()
    assert s.sample_now()["nvme_peak_mib"] == 0.0
    assert s.peaks()["nvme_peak_mib"] == pytest.approx(20.0)


def test_missing_nvme_dir_measures_zero(tmp_path):
    assert MemorySampler(nvme_dir=tmp_path / "not-yet").sample_now()["nvme_peak_mib"] == 0.0


# ------------------------------------------------------------------ thread lifecycle
def test_stop_joins_thread_and_is_idempotent():
    s = MemorySampler(interval_s=INTERVAL).start()
    assert len(sampler_threads()) == 1 and sampler_threads()[0].daemon
    s.stop()
    assert sampler_threads() == []
    s.stop()
    with pytest.raises(RuntimeError):
        s.start().start()
    s.stop()


def test_thread_stops_when_with_block_raises():
    with pytest.raises(KeyError), MemorySampler(interval_s=INTERVAL):
        assert len(sampler_threads()) == 1
        raise KeyError("boom")
    assert sampler_threads() == []


def test_concurrent_sample_now_is_safe():
    with MemorySampler(interval_s=0.001) as s:
        workers = [threading.Thread(target=lambda: [s.sample_now() for _ in range(50)]) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert s.stats()["samples"] >= 200
    assert s.peaks()["host_peak_rss_mib"] >= s.sample_now()["host_peak_rss_mib"] > 0


# ------------------------------------------------------------------ StepTimer
class FakeClock:
    def __init__(self, times: list[float], events: list[str]) -> None:
        self.times, self.events = iter(times), events

    def __call__(self) -> float:
        self.events.append("clock")
        return next(self.times)


def make_timer(durations: list[float], events: list[str]) -> StepTimer:
    times, t = [], 0.0
    for d in durations:
        times += [t, t + d]
        t += d + 1.0  # gaps between steps (data loading, logging) are not step time
    return StepTimer(
        clock=FakeClock(times, events),
        synchronize=lambda: events.append("sync"),
        wall_clock=lambda: 1000.5,
        process_start=1000.0,
    )


def test_step_timer_synchronizes_before_each_clock_read():
    events: list[str] = []
    timer = make_timer([0.25], events)
    timer.start_step()
    assert timer.end_step(samples=8) == pytest.approx(0.25)
    assert events == ["sync", "clock", "sync", "clock"]
    with pytest.raises(RuntimeError):
        timer.end_step(samples=8)


def test_step_timer_statistics_exclude_warmup():
    durations = [5.0, 0.2, 0.4, 0.3, 0.5, 0.1]  # the first step compiles: 25x slower
    timer = make_timer(durations, [])
    for _ in durations:
        timer.start_step()
        timer.end_step(samples=4)
    s = timer.summary(warmup_steps=1)
    assert s["steps_timed"] == 5 and s["warmup_steps"] == 1
    assert s["step_time_median_s"] == pytest.approx(0.3)
    assert s["step_time_p90_s"] == pytest.approx(0.46)  # sorted .1 .2 .3 .4 .5, rank 3.6 -> .4 + .6 * .1
    assert s["step_time_p90_s"] == pytest.approx(np.percentile(durations[1:], 90))
    assert s["samples_per_s"] == pytest.approx(20 / 1.5)
    assert s["startup_s"] == pytest.approx(0.5)

    s0 = timer.summary(warmup_steps=0)
    assert s0["steps_timed"] == 6 and s0["step_time_median_s"] == pytest.approx(0.35)
    assert s0["samples_per_s"] == pytest.approx(24 / 6.5)


def test_step_timer_all_warmup_gives_none():
    timer = make_timer([0.1, 0.2], [])
    assert timer.summary(warmup_steps=0)["step_time_median_s"] is None  # no steps yet
    for _ in range(2):
        timer.start_step()
        timer.end_step(samples=1)
    s = timer.summary(warmup_steps=5)
    assert s["step_time_median_s"] is None and s["step_time_p90_s"] is None and s["samples_per_s"] is None
    assert s["steps_timed"] == 0 and s["warmup_steps"] == 2


def test_step_timer_startup_defaults_to_process_create_time():
    timer = StepTimer(synchronize=lambda: None)
    timer.start_step()
    timer.end_step(samples=1)
    age = time.time() - process_start_time()
    assert 0 < timer.startup_s <= age + 0.05
    # The absolute end of the first step, for a caller timing from its own start (benchmarks/)
    assert abs(timer.summary(0)["first_step_end_unix"] - (process_start_time() + timer.startup_s)) < 0.05


def test_process_start_time_is_when_the_process_was_started():
    # psutil's create_time is off by the boot time's rounding to whole seconds (up to 1 s); this must not be.
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    after = time.time()
    try:
        started = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= started <= after + 2 * tick, (before, started, after)
    assert abs(process_start_time() - psutil.Process().create_time()) < 1.0  # the same clock, give or take rounding


# ------------------------------------------------------------------ plot
@pytest.mark.parametrize("with_gpu", [False, True])
def test_plot_run_writes_png(tmp_path, with_gpu):
    rows = [
        {
            "step": i,
            "loss": 1.0 / (i + 1),
            "lr": 1e-4,
            "perf/step_time_s": 0.3 + 0.01 * i,
            "memory/host_rss_mib": 1000.0 + i,
            "memory/gpu_process_mib": 5000.0 + 10 * i if with_gpu else None,
        }
        for i in range(5)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plots" / "run.png"
    assert plot_run(metrics, out) == os.fspath(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# ------------------------------------------------------------------ start-up phases
def test_startup_view_splits_the_time_to_the_first_step(monkeypatch):
    from zerotune.host import timing as startup

    clock = iter([101.0, 101.5, 102.5, 103.0, 103.4, 103.4, 104.9])
    monkeypatch.setattr(startup.time, "time", lambda: next(clock))
    monkeypatch.setattr(startup, "_jobs_in_this_process", 0)
    monkeypatch.setattr(startup, "process_start_time", lambda: 100.0)  # the process's creation
    marks = startup.ParentMarks()
    for name in ("compose_and_imports", "launch_checks", "launcher_imports"):
        marks.mark(name)
    checks = startup.Marks()  # 103.0: beside the workers' start
    for name in ("checks", "plan", "ops_build"):
        checks.mark(name)
    worker = {"process_start": 102.6, "gate_reached": 106.0, "gate_open": 106.0, "train_start": 106.1,
              "ready": 108.0, "first_step_end": 108.5}
    view = startup.startup_view(marks, worker, checks)
    assert view["parent"] == {"compose_and_imports": 1.0, "launch_checks": 0.5, "launcher_imports": 1.0}
    assert view["checks"] == {"checks": 0.4, "plan": 0.0, "ops_build": 1.5}
    assert view["worker"] == {"start_and_imports_s": 3.5, "waiting_for_checks_s": 0.0, "setup_s": 2.0,
                              "first_step_s": 0.5}
    assert view["to_first_step_s"] == 8.5 and view["ops_build_s"] == 1.5
    assert view["to_first_step_without_ops_build_s"] == 8.5  # the build ended before the imports: nothing waited
    # A cold build the workers waited on: the wait (at most the build) comes off the job's own start-up.
    cold = startup.startup_view(marks, {**worker, "gate_open": 107.2, "ready": 109.2, "first_step_end": 109.7},
                                checks)
    assert cold["worker"]["waiting_for_checks_s"] == 1.2 and cold["to_first_step_s"] == 9.7
    assert cold["to_first_step_without_ops_build_s"] == 8.5
    # Under an external launcher (torchrun) there is no parent and no gate: the worker's own process start counts.
    alone = startup.startup_view(None, {k: v for k, v in worker.items() if not k.startswith("gate")})
    assert alone["worker"] == {"start_and_imports_s": 3.5, "setup_s": 1.9, "first_step_s": 0.5}
    assert alone["to_first_step_s"] == pytest.approx(5.9) and "parent" not in alone and "ops_build_s" not in alone
    # A worker that died before its first step: unmeasured, not zero.
    assert startup.startup_view(None, {**worker, "first_step_end": None})["to_first_step_s"] is None


def test_a_sweeps_later_jobs_start_when_the_sweep_reaches_them(monkeypatch):
    from zerotune.host import timing as startup

    monkeypatch.setattr(startup, "_jobs_in_this_process", 0)
    first = startup.ParentMarks()
    assert first.start == pytest.approx(process_start_time(), abs=0.01)
    later = startup.ParentMarks()
    assert later.start > first.start and abs(later.start - time.time()) < 1


def test_perf_startup_leaves_out_the_wait_at_the_gate():
    from zerotune.host.timing import gate_wait_s
    from zerotune.train.run import RunTelemetry

    assert gate_wait_s({"gate_reached": 10.0, "gate_open": 80.5}) == 70.5  # a cold op build the worker waited on
    assert gate_wait_s({"gate_reached": 10.0}) == 0.0 and gate_wait_s({}) == 0.0  # no gate (torchrun & co.)
    started = time.time() - 72.0  # created 72 s ago, 70 s of which were spent at the gate
    telemetry = RunTelemetry(nvme_dir=None, synchronize=lambda: None, started=started + 70.0)
    telemetry.timer.start_step()
    telemetry.timer.end_step(samples=1)
    assert 1.9 < telemetry.timer.startup_s < 2.5

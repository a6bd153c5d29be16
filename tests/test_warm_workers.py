"""The warm template's choice of worker command, and its stub (job/warm.py, warm_stub.py). The template
serving real trials: the one end-to-end tune run (tests/test_tune_sweep.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.helpers.cli import ROOT


def test_workers_fork_from_the_template_only_for_this_process_and_only_while_it_is_up(tmp_path, monkeypatch):
    """A job this process launches uses the template's socket; one whose process merely inherited the variable
    (a job submitted elsewhere), or that finds no socket, starts its worker cold."""
    from zerotune.job import warm

    args = ("123", "/run", "token")
    socket_file = tmp_path / "template.sock"
    socket_file.touch()
    monkeypatch.setenv(warm.WARM_ENV, f"{socket_file}:{os.getpid()}:999")
    cold = ("-u", "-m", "zerotune.job.bootstrap", *args)
    assert warm.worker_args(args) == ("-u", "-m", "zerotune.job.warm_stub", str(socket_file), *args)
    assert warm.template_pids() == {999}  # not one of a job's processes: its memory is not the trial's
    monkeypatch.setenv(warm.WARM_ENV, f"{socket_file}:{os.getpid() + 1}:999")
    assert warm.worker_args(args) == cold
    monkeypatch.setenv(warm.WARM_ENV, f"{tmp_path / 'gone.sock'}:{os.getpid()}:999")
    assert warm.worker_args(args) == cold
    monkeypatch.delenv(warm.WARM_ENV)
    assert warm.worker_args(args) == cold


@pytest.mark.parametrize("module", ["zerotune.job.bootstrap", "zerotune.job.warm_stub"])
def test_a_worker_whose_job_process_is_gone_ends_before_its_imports(tmp_path, module):
    """Both first lines a worker can start from, as the launcher runs them (`python -m`), end at once where their
    parent is not the job process that started them (here pid 1), before importing torch."""
    stub_socket = [str(tmp_path / "none.sock")] if module.endswith("warm_stub") else []
    done = subprocess.run([sys.executable, "-u", "-X", "importtime", "-m", module, *stub_socket, "1", "/run", "token"],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "the job process that started this worker is gone" in done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "import time:" in line}
    assert "zerotune.job" in imported and "torch" not in imported and "zerotune.job.worker" not in imported


def _stub(path, parent: str = "1") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys; from zerotune.job.warm_stub import run; "
                             "run(sys.argv[1], sys.argv[2:])", str(path), parent, "/run", "token"],
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(("status", "returncode"), [(0, 0), (3, 3), (-signal.SIGKILL, -signal.SIGKILL),
                                                    (-signal.SIGTERM, -signal.SIGTERM)])
def test_the_stub_exits_as_its_worker_did(tmp_path, status, returncode):
    """The launcher reads the stub's status as the worker's: an exit code, or death by a signal (a worker the
    kernel killed for memory must read as SIGKILL, which is how a host OOM is told)."""
    path = tmp_path / "t.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(path))
    server.listen(1)
    stub = _stub(path)
    conn, _ = server.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    assert len(fds) == 3 and request["argv"][1:] == ["1", "/run", "token"] and request["cwd"] == os.getcwd()
    for fd in fds:
        os.close(fd)
    conn.send(b"4242")
    conn.send(json.dumps({"status": status}).encode())
    assert stub.wait(timeout=30) == returncode, stub.stderr.read()
    conn.close()
    server.close()


def test_without_a_template_the_stub_becomes_a_cold_worker(tmp_path):
    """No socket: the stub execs the usual bootstrap, whose first check then runs (its parent is not pid 1)."""
    stub = _stub(tmp_path / "none.sock", parent="1")
    _, err = stub.communicate(timeout=60)
    assert stub.returncode != 0 and "the job process that started this worker is gone" in err


@pytest.mark.parametrize("poisoned", [False, True])
def test_the_template_asks_a_forked_child_whether_cuda_is_still_usable(monkeypatch, poisoned):
    """On a card, torch marks a child forked after CUDA's driver started as unable to use it; the template asks
    a throwaway child and serves only where it is not marked (no card here: torch's answers are stood in)."""
    import torch

    from zerotune.job import warm

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: poisoned)
    assert warm._cuda_poisons_fork() is poisoned


@pytest.mark.parametrize(("compiled", "nvml_count", "driver_library", "present"), [
    (False, 0, None, False),              # a CPU-only torch
    (True, -1, None, False),              # PyPI's CUDA build on a host with no GPU and no driver
    (True, 0, "libcuda.so.1", False),     # a driver, and NVML counts no device (none visible)
    (True, 2, "libcuda.so.1", True),      # a card
    (True, -1, "libcuda.so.1", True),     # a driver NVML cannot speak for: assumed a card
])
def test_a_cuda_build_without_a_gpu_is_a_cpu_host(monkeypatch, compiled, nvml_count, driver_library, present):
    """Where no device is present a forked worker has no card to lose: the template serves even though torch
    marks its children (a CUDA build does after any device count), and imports DeepSpeed and Optuna too."""
    import ctypes.util
    import importlib

    import torch

    from zerotune.host import platform
    from zerotune.job import warm

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: compiled)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: nvml_count)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: driver_library if name == "cuda" else None)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert platform.cuda_device_present() is present
    assert warm._cuda_poisons_fork() is present
    importlib.import_module("zerotune.job.worker")  # the worker's own imports, before they are watched
    imported: list[str] = []
    monkeypatch.setattr(importlib, "import_module", imported.append)
    warm.import_worker_modules()
    assert imported == ([] if present else list(warm.SETUP_MODULES))


def test_the_template_starts_with_nvml_answering_whether_cuda_is_there(monkeypatch, tmp_path):
    """Without it, the imports' torch.cuda.is_available() starts CUDA's driver and no forked worker can use the
    card (measured on an H200: experiments/results/gpu/h200-2026-11-27)."""
    from zerotune.job import warm

    started: dict = {}

    class Proc:
        pid = 4242

        def terminate(self) -> None: ...

        def wait(self, timeout: float | None = None) -> int:
            return 0

    def popen(args, **kwargs):
        started.update(kwargs)
        return Proc()

    monkeypatch.setattr(warm.subprocess, "Popen", popen)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    with warm.template(tmp_path / "warm_template.log"):
        pass
    assert started["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # the sweep's own and its workers' stay as they were


@pytest.mark.slow  # 8 s; the default suite's tune run forks every trial from the template (test_tune_sweep.py)
def test_the_template_imports_what_a_trials_setup_would_and_runs_no_thread_after():
    """On this CPU-only torch the template also imports DeepSpeed (with its op loader) and Optuna, which every
    trial's setup would otherwise import again (0.3 s a trial); none of it may leave a Python thread running,
    or the template would not fork (trials would start cold)."""
    code = ("import sys, threading\n"
            "from zerotune.job.warm import import_worker_modules\n"
            "import_worker_modules()\n"
            "print(sorted(m for m in ('deepspeed', 'optuna', 'torch.utils.cpp_extension') if m in sys.modules),"
            " threading.active_count())\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['deepspeed', 'optuna', 'torch.utils.cpp_extension'] 1"

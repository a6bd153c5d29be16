"""`zerotune doctor` (`python -m zerotune doctor`) on this machine: each line states the truth of the machine, and
each problem comes with its fix. The machine as it is, through the command run as users run it; each case, through
its main() in this process."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import ROOT, call_main, cli_env
from zerotune.cli.doctor import main as doctor_main

STATUSES = ("OK", "INFO", "WARN", "FAIL")
NAMES = ["configs", "platform", "build tools", "ops", "libaio", "offload path", "locks", "gpus", "accelerate"]


def doctor_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotune", "doctor", *args], cwd=ROOT, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=180)


@pytest.fixture
def doctor(monkeypatch):
    """The doctor's main(argv) in this process, with `env` set for the call: the checks read the environment
    when they run, so this says what the command says (`report` below, and tests/test_console_scripts.py, run
    it as a process) without a process's seconds of imports."""
    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        with monkeypatch.context() as patch:
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            return call_main(doctor_main, *args)
    return run


def lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """{check name: its line}, from the text report."""
    found = {}
    for line in proc.stdout.splitlines():
        status = line[:4].strip()
        if status in STATUSES:
            name = next(n for n in NAMES if line[6:].startswith(n))
            found[name] = line
    return found


def fix_of(proc: subprocess.CompletedProcess, name: str) -> str:
    out = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line[6:].startswith(name))
    return out[at + 1].strip() if at + 1 < len(out) and out[at + 1].strip().startswith("fix:") else ""


@pytest.fixture
def tex(tmp_path) -> Path:
    root = tmp_path / "torch_extensions"
    root.mkdir()
    return root


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> subprocess.CompletedProcess:
    """The doctor on this machine as it is, but for accelerate's config folder (HF_HOME): an empty one."""
    return doctor_process(env={"HF_HOME": str(tmp_path_factory.mktemp("hf_home"))})


def test_every_check_has_one_line_and_problems_have_fixes(report):
    assert report.returncode in (0, 1), report.stderr[-2000:]
    found = lines(report)
    assert list(found) == NAMES
    for name, line in found.items():
        if line.startswith(("WARN", "FAIL")):
            assert fix_of(report, name).startswith("fix: "), name
    assert report.returncode == (1 if any(line.startswith("FAIL") for line in found.values()) else 0)


def test_the_platform_line_names_versions_and_the_cpu_accelerator(report):
    import deepspeed
    import torch

    line = lines(report)["platform"]
    assert line.startswith("OK") and f"torch {torch.__version__}" in line and f"deepspeed {deepspeed.__version__}" in line
    assert f"python {sys.version.split()[0]}" in line
    if not torch.cuda.is_available():
        assert "DeepSpeed's accelerator: cpu" in line and "runs here" in line
        assert lines(report)["gpus"].startswith("INFO") and "none visible" in lines(report)["gpus"]


def test_the_libaio_line_matches_dpkg(report):
    line = lines(report)["libaio"]
    if shutil.which("dpkg") is None:
        pytest.skip("no dpkg here")
    installed = subprocess.run(["dpkg", "-s", "libaio-dev"], capture_output=True).returncode == 0
    assert ("libaio-dev installed" if installed else "libaio-dev not installed") in line
    if not installed:
        assert line.startswith(("WARN", "FAIL")) and "apt-get install libaio-dev" in fix_of(report, "libaio")


def test_ops_are_listed_as_built_only_where_the_cache_has_them(tex, doctor):
    (tex / "cpu_adam").mkdir()
    (tex / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # what a finished build leaves
    proc = doctor("--json", env={"TORCH_EXTENSIONS_DIR": str(tex)})
    ops = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}["ops"]
    table = ops["details"]["ops"]
    assert table["cpu_adam"]["cached"] is True and table["cpu_lion"]["cached"] is False
    assert "built: cpu_adam;" in ops["summary"] and "cpu_lion" in ops["summary"].split("built on first use:")[1]


def test_a_stale_lock_is_a_problem_with_its_path_and_fix(tex, doctor):
    lock = tex / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # left by a killed build: open nowhere
    proc = doctor(env={"TORCH_EXTENSIONS_DIR": str(tex)})
    line = lines(proc)["locks"]
    assert line.startswith("WARN") and f"{lock} is stale" in line
    assert f"rm {lock}" in fix_of(proc, "locks") and "safe" in fix_of(proc, "locks")
    assert lock.exists()  # reported, not touched, without --fix
    fixed = doctor("--fix", env={"TORCH_EXTENSIONS_DIR": str(tex)})
    assert lines(fixed)["locks"].startswith("OK") and f"{lock} is removed" in lines(fixed)["locks"]
    assert not lock.exists()


def test_a_writable_offload_path_shows_its_free_space(tmp_path, doctor):
    proc = doctor("--offload-path", str(tmp_path))
    line = lines(proc)["offload path"]
    assert line.startswith("OK") and f"{tmp_path} is writable" in line
    number, unit = re.search(r"is writable, ([\d.]+) (GiB|MiB) free", line).groups()
    shown = float(number) * (2**30 if unit == "GiB" else 2**20)
    assert abs(shown - shutil.disk_usage(tmp_path).free) < 2**30  # other writers may run beside


@pytest.mark.parametrize("how", ["chmod", "proc"])
def test_an_unwritable_offload_path_fails_with_exit_1(tmp_path, doctor, how):
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a mode-500 folder anyway")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
    else:
        folder = Path("/proc/self")  # no file can be created there, not even by root
    try:
        proc = doctor("--offload-path", str(folder))
    finally:
        if how == "chmod":
            folder.chmod(0o700)
    line = lines(proc)["offload path"]
    assert proc.returncode == 1
    assert line.startswith("FAIL") and str(folder) in line
    assert "offload.path" in fix_of(proc, "offload path")


def test_the_composed_config_gives_the_offload_path(tmp_path, doctor):
    """offload=nvme offload.path=...: that folder is checked, with what the run would swap there."""
    proc = doctor("zero_stage=3", "offload=nvme", f"offload.path={tmp_path}")
    line = lines(proc)["offload path"]
    assert f"{tmp_path} is writable" in line and "the run swaps about" in line


def test_json_parses_and_agrees_with_the_exit_code(tmp_path, doctor):
    proc = doctor("--json", "--offload-path", "/proc/self")
    answer = json.loads(proc.stdout)
    checks = {c["name"]: c for c in answer["checks"]}
    assert list(checks) == NAMES
    assert checks["offload path"]["status"] == "FAIL" and checks["offload path"]["fix"]
    assert answer["failed"] >= 1 and proc.returncode == 1
    assert checks["platform"]["details"]["accelerator"]


def test_the_accelerate_default_config_in_effect_is_shown(isolated_accelerate_config, doctor):
    folder = isolated_accelerate_config / "accelerate"  # HF_HOME: accelerate's default location is under it
    folder.mkdir()
    (folder / "default_config.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
        "deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n")
    line = lines(doctor())["accelerate"]
    assert str(folder / "default_config.yaml") in line
    assert "zero_stage 3" in line and "mixed_precision bf16" in line and "num_processes 2" in line
    (folder / "default_config.yaml").write_text("distributed_type: [unclosed\n")
    proc = doctor()
    assert lines(proc)["accelerate"].startswith("FAIL") and "accelerate.config_file=null" in fix_of(proc, "accelerate")

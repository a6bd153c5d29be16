"""A user's install: the wheel into a fresh venv (dependencies resolved from the package indexes), then every
kind of `zerotune` use run from an empty folder, far from any checkout. Each step's time is printed (-s)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import ROOT, cli_env, stop_process
from tests.helpers.wheel import build_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TORCH = "torch==2.13.0"  # first and pinned, as the Makefile does: a bare `torch` pulls CUDA wheels

MINE = """\
# @package _global_
defaults:
  - override /data: synthetic
  - override /zero_stage: "1"
  - override /resolution: "8"
train:
  max_steps: 2
  batch_size: 8
"""


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Steps:
    """Runs commands in the user's folder with the fresh venv's environment, timing each."""

    def __init__(self, venv: Path, work: Path, env: dict):
        self.venv, self.work, self.env = venv, work, env
        self.times: list[tuple[str, float]] = []

    def timed(self, label: str, cmd: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout)
        self.record(label, time.monotonic() - start)
        assert proc.returncode == 0, f"{label}: exit {proc.returncode}\n{tail(proc.stdout)}\n{tail(proc.stderr)}"
        return proc

    def zerotune(self, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        return self.timed("zerotune " + " ".join(args), [str(self.venv / "bin" / "zerotune"), *args], timeout)

    def record(self, label: str, seconds: float) -> None:
        self.times.append((label, seconds))
        print(f"  {seconds:7.1f} s  {label}", flush=True)

    def report(self) -> None:
        print(f"  {sum(s for _, s in self.times):7.1f} s  total", flush=True)


def user_env(tmp: Path) -> dict:
    """The suite's environment with nothing leading back to the checkout or its venv (the binary is run by
    its path, unactivated: whatever it starts must find its own interpreter)."""
    env = cli_env()
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and not Path(p).resolve().is_relative_to(ROOT))
    # This venv's DeepSpeed lies elsewhere, so its ops build with other flags: a shared extensions cache
    # would be rebuilt back and forth with the dev venv's.
    env["TORCH_EXTENSIONS_DIR"] = str(tmp / "torch_extensions")
    return env


def package_files(folder: Path) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime)} of an installed package's files (bytecode Python may cache left out)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def run_dirs(root: Path) -> list[dict]:
    return [json.loads(s.read_text()) for s in sorted(root.rglob("summary.json"))]


def install(steps: Steps, tmp: Path) -> None:
    """The wheel built from the tracked files, installed after the pinned torch into a new venv at steps.venv."""
    start = time.monotonic()
    wheel = build_wheel(tmp / "build")
    steps.record(f"build {wheel.name}", time.monotonic() - start)
    # From the suite's interpreter (the same Python the torch wheel is built for); a venv without
    # --system-site-packages inherits none of the dev venv's packages.
    steps.timed("python -m venv", [sys.executable, "-m", "venv", str(steps.venv)], timeout=300)
    pip = [str(steps.venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    steps.timed(f"pip install {TORCH}", [*pip, TORCH], timeout=1200)
    steps.timed(f"pip install {wheel.name}", [*pip, str(wheel)], timeout=1800)


def test_the_wheel_installs_into_a_fresh_venv_and_every_command_runs_from_an_empty_folder(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    steps = Steps(venv, work, user_env(tmp_path))
    print()
    try:
        install(steps, tmp_path)
        where = steps.timed("import zerotune", [str(venv / "bin" / "python"), "-c",
                                                "import sys, zerotune; print(zerotune.__file__); print(sys.path)"])
        package = Path(where.stdout.splitlines()[0]).parent
        assert package.is_relative_to(venv) and str(ROOT) not in where.stdout, where.stdout
        plugin = package.parent / "hydra_plugins" / "zerotune_user_configs"
        assert (package / "config" / "conf" / "config.yaml").is_file() and (plugin / "__init__.py").is_file()
        before = {"zerotune": package_files(package), "plugin": package_files(plugin)}
        assert list(work.iterdir()) == []

        check_train(steps, work)
        check_sweep(steps, work)
        check_plan_and_ds_config(steps)
        check_builder_saves_into_the_users_folder(steps, work, package)
        check_user_experiment(steps, work)

        assert {"zerotune": package_files(package), "plugin": package_files(plugin)} == before
        assert not list(package.rglob("outputs")) and not list(package.rglob("multirun"))
        shutil.rmtree(venv)  # 1.6 GB; pytest keeps its last temporary folders (a failed run's venv stays)
    finally:
        steps.report()


def check_train(steps: Steps, work: Path) -> None:
    steps.zerotune("train", "train.max_steps=3")
    [summary] = run_dirs(work / "outputs")
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert Path(summary["run_dir"]).is_relative_to(work / "outputs")


def check_sweep(steps: Steps, work: Path) -> None:
    # synthetic data's default is 128 px at batch 64: minutes a step on a small CPU
    steps.zerotune("train", "-m", "zero_stage=1,2", "train.max_steps=2", "data=synthetic", "model=tiny",
                   "resolution=8", "train.batch_size=8")
    jobs = run_dirs(work / "multirun")
    assert [j["status"] for j in jobs] == ["ok", "ok"], jobs
    assert sorted(j["choices"]["zero_stage"] for j in jobs) == [1, 2]


def check_plan_and_ds_config(steps: Steps) -> None:
    plan = json.loads(steps.zerotune("plan", "model=sdxl", "resolution=1024", "--gpu", "rtx4090", "--json").stdout)
    assert plan["gpu_peak_mib"] > 0 and isinstance(plan["fits"], bool)
    ds = json.loads(steps.zerotune("ds-config", "zero_stage=3", "offload=cpu").stdout)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def check_builder_saves_into_the_users_folder(steps: Steps, work: Path, package: Path) -> None:
    """No ./zerotune/ yet: the page's save creates it, in the working directory, never in the package."""
    assert not (work / "zerotune").exists()
    start = time.monotonic()
    with open(work.parent / "builder-stderr.txt", "w") as log:
        server = subprocess.Popen([str(steps.venv / "bin" / "zerotune"), "builder", "--port", "0"], cwd=work,
                                  env=steps.env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        first = server.stdout.readline().strip()  # the URL alone, once the app is ready
        found = re.search(r"^zerotune config builder: (http://127\.0\.0\.1:\d+/)\?token=([\w-]+)$", first)
        assert found, first + tail((work.parent / "builder-stderr.txt").read_text())
        base, token = found.groups()
        body = {"name": "from_builder", "choices": {"zero_stage": "3", "data": "synthetic"},
                "values": {"train.max_steps": "2"}, "extra": []}
        request = urllib.request.Request(base + "api/experiment", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "X-Zerotune-Token": token})
        with urllib.request.urlopen(request, timeout=120) as answer:
            saved = json.loads(answer.read())
    finally:
        stop_process(server)
        server.stdout.close()
        steps.record("zerotune builder: start, save an experiment, stop", time.monotonic() - start)
    mine = work / "zerotune" / "experiment" / "from_builder.yaml"
    assert Path(saved["path"]).resolve() == mine.resolve() and mine.is_file(), saved
    assert "override /zero_stage: '3'" in mine.read_text()
    assert not list(package.rglob("from_builder.yaml"))
    shown = steps.zerotune("train", "experiment=from_builder", "--cfg", "job")
    assert re.search(r"^zero_stage:\n  stage: 3$", shown.stdout, re.MULTILINE), shown.stdout


def check_user_experiment(steps: Steps, work: Path) -> None:
    (work / "zerotune" / "experiment" / "mine.yaml").write_text(MINE)
    before = {s["run_dir"] for s in run_dirs(work / "outputs")}
    steps.zerotune("train", "experiment=mine")
    [summary] = [s for s in run_dirs(work / "outputs") if s["run_dir"] not in before]
    assert summary["status"] == "ok" and summary["steps"] == 2 and summary["choices"]["data"] == "synthetic"
    assert summary["choices"]["zero_stage"] == 1 and summary["choices"]["batch_size"] == 8
    hydra = yaml.safe_load((Path(summary["run_dir"]) / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra["runtime"]["choices"]["experiment"] == "mine"


def test_a_venv_under_a_path_with_a_space_trains_with_deepspeed(tmp_path):
    """torch's JIT build passes `-L<torch>/lib` to the linker unquoted: from a venv in "über proj", DeepSpeed's
    ops link through a link in the extensions cache. A cache whose path has a space too is refused before any
    build, naming TORCH_EXTENSIONS_DIR, and the fix it gives, applied, trains."""
    venv, work = tmp_path / "über proj" / "venv", tmp_path / "work dir"
    work.mkdir()
    env = user_env(tmp_path)
    steps = Steps(venv, work, env)
    print()
    try:
        install(steps, tmp_path)
        # A home of its own: the fix names a folder in it.
        env.update(HOME=str(tmp_path / "home"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext cache"))
        start = time.monotonic()
        refused = subprocess.run([str(venv / "bin" / "zerotune"), "train", "train.max_steps=2"], cwd=work, env=env,
                                 capture_output=True, text=True, timeout=900)
        steps.record("zerotune train (a cache with a space): refused", time.monotonic() - start)
        assert refused.returncode == 2, tail(refused.stdout) + tail(refused.stderr)
        assert "config error at `TORCH_EXTENSIONS_DIR`" in refused.stderr and "-lc10" in refused.stderr
        assert not (tmp_path / "ext cache").exists()

        name, value = re.search(r"^  fix: .*export (\w+)=(\S+)$", refused.stderr, re.MULTILINE).groups()
        env[name] = value  # the fix, as given
        steps.zerotune("train", "train.max_steps=2")
        refusal, summary = run_dirs(work / "outputs")  # in the order they ran
        assert refusal["status"] == "failed" and refusal["error"]["key"] == "TORCH_EXTENSIONS_DIR"
        assert summary["status"] == "ok" and summary["steps"] == 2 and summary["use_deepspeed"]
        [shm] = [op for op in summary["ops_build"]["ops"] if op["name"] == "deepspeed_shm_comm"]
        assert not shm["was_cached"] and Path(shm["path"]).is_relative_to(value)
        ninja = (Path(shm["path"]).parent / "build.ninja").read_text()
        [link] = re.findall(r"^ldflags = .*-L(\S+) ", ninja, re.MULTILINE)
        assert Path(link).parent == Path(value) and Path(link).resolve() == (
            next(venv.glob("lib/python*/site-packages/torch/lib")).resolve())
        shutil.rmtree(venv)
    finally:
        steps.report()

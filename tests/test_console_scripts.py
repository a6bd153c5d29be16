"""The one console script pyproject.toml installs, `zerotune`: every subcommand starts and does its job."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.cli import ROOT, cli_env, stop_process
from zerotune.cli.command import COMMANDS

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
ZEROTUNE = Path(sys.executable).parent / "zerotune"


def zerotune(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(ZEROTUNE), *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=180)


def test_the_one_script_is_zerotune_and_its_commands_are_the_ones_tested_here():
    assert SCRIPTS == {"zerotune": "zerotune.cli.command:main"}
    assert set(COMMANDS) == {"train", "tune", "plan", "ds-config", "import-config", "export", "report", "doctor",
                             "builder"}


def test_help_lists_every_command():
    proc = zerotune("--help")
    assert proc.returncode == 0, proc.stderr
    listed = re.findall(r"^  (\S+)  ", proc.stdout, re.MULTILINE)
    assert listed == list(COMMANDS)


def test_no_command_is_usage_and_exit_2():
    proc = zerotune()
    assert proc.returncode == 2 and "usage: zerotune <command>" in proc.stderr


def test_an_unknown_command_exits_2_naming_the_choices():
    proc = zerotune("trian", "zero_stage=3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no command 'trian'" in proc.stderr and ", ".join(COMMANDS) in proc.stderr


def test_train_help_shows_hydras_config_groups():
    proc = zerotune("train", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "== Configuration groups ==" in proc.stdout
    groups = dict(re.findall(r"^(\w+): (.+)$", proc.stdout.split("== Config ==")[0], re.MULTILINE))
    assert "0, 1, 2, 3" in groups["zero_stage"] and "cpu" in groups["offload"] and "sdxl" in groups["model"]
    assert "sdxl_4090_1024_bs8" in groups["experiment"]


def test_train_cfg_job_prints_the_composed_config(tmp_path):
    proc = zerotune("train", "--cfg", "job", "zero_stage=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^zero_stage:\n  stage: 3$", proc.stdout, re.MULTILINE), proc.stdout
    assert not (tmp_path / "outputs").exists()  # printing the config runs nothing


def test_zerotune_tune_for_a_card_not_here_ranks_by_the_planner_and_runs_nothing(tmp_path):
    proc = zerotune("tune", "model=tiny", "data=synthetic", "resolution=8", "precision=bf16", "zero_stage=2",
                    "offload=none,cpu", "train.gradient_checkpointing=false", "deepspeed.overlap_comm=false",
                    "hydra.sweeper.global_batch=8", "--gpu", "rtx4090", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "sweep" / "tune.md").read_text()
    assert "predicted by the planner's time floor (no trial ran)" in report and "bound by compute" in report
    assert [p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()] == []  # no job ran
    winner = tmp_path / "zerotune" / "experiment" / "tuned_tiny_8_gb8_rtx4090.yaml"
    assert "not measured" in winner.read_text()


@pytest.mark.parametrize(("args", "key"), [(["resolution=8,16"], "resolution"),
                                           (["hydra.sweeper.pruner=median"], "hydra.sweeper.pruner")])
def test_zerotune_tune_refuses_bad_input_naming_the_key(tmp_path, args, key):
    proc = zerotune("tune", "model=tiny", "data=synthetic", *args, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert proc.returncode == 2 and f"config error at `{key}`" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "sweep" / "0").exists()


def test_zerotune_ds_config_prints_the_json():
    proc = zerotune("ds-config", "zero_stage=3", "offload=cpu")
    assert proc.returncode == 0, proc.stderr
    ds = json.loads(proc.stdout)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_python_m_zerotune_is_the_same_command():
    proc = subprocess.run([sys.executable, "-m", "zerotune", "ds-config", "zero_stage=1"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["zero_optimization"]["stage"] == 1


def test_zerotune_plan_prints_the_prediction():
    proc = zerotune("plan", "--gpu", "rtx4090", "--json", "zero_stage=3")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["gpu_peak_mib"] > 0 and plan["fits"] is True and "ZeRO-3" in plan["workload"]


def test_zerotune_import_config_prints_overrides():
    proc = zerotune("import-config", str(ROOT / "tests/data/ds_configs/accelerate_reference.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["zero_stage=1", "precision=bf16"]


def test_zerotune_doctor_checks_this_machine(tmp_path):
    proc = zerotune("doctor", "--json", "--offload-path", str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["offload path"]["status"] == "OK" and checks["offload path"]["details"]["path"] == str(tmp_path)
    assert checks["platform"]["details"]["accelerator"]
    assert proc.returncode == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)


def start_builder(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """The server, and the first line it printed (stdout is the URL alone: DeepSpeed's logs go to stderr)."""
    log = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115  (the child holds it; closed when the server stops)
    server = subprocess.Popen([str(ZEROTUNE), "builder", "--port", "0", *args], cwd=ROOT, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    return server, server.stdout.readline().strip()


def stop(server: subprocess.Popen) -> None:
    stop_process(server)
    server.stdout.close()


def test_zerotune_builder_serves_the_page_and_a_taken_port_is_a_clear_error(tmp_path):
    server, first = start_builder(tmp_path)
    try:
        found = re.search(r"^zerotune config builder: http://127\.0\.0\.1:(\d+)/\?token=[\w-]+$", first)
        assert found, first + (tmp_path / "stderr.txt").read_text()
        with urllib.request.urlopen(first.split()[-1], timeout=60) as page:
            assert page.status == 200 and b"zerotune config builder" in page.read()
        taken = zerotune("builder", "--port", found.group(1))
        assert taken.returncode == 2 and "cannot listen on 127.0.0.1:" in taken.stderr and "--port 0" in taken.stderr
    finally:
        stop(server)


def test_zerotune_builder_without_a_token_warns_and_still_checks_the_host(tmp_path):
    server, first = start_builder(tmp_path, "--no-token")
    try:
        found = re.search(r"^zerotune config builder: (http://127\.0\.0\.1:\d+/)$", first)
        assert found, first + (tmp_path / "stderr.txt").read_text()
        assert "--no-token" in (tmp_path / "stderr.txt").read_text()
        with urllib.request.urlopen(found.group(1) + "api/experiments", timeout=60) as answer:
            assert answer.status == 200 and "names" in json.loads(answer.read())
        rebound = urllib.request.Request(found.group(1) + "api/experiments", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(rebound, timeout=60)
        assert refused.value.code == 403
    finally:
        stop(server)

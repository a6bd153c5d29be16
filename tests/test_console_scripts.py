"""Every console script pyproject.toml installs starts and does its job."""

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

from tests.helpers.cli import ROOT, cli_env

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
BIN = Path(sys.executable).parent


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=180)


def test_the_scripts_tested_here_are_all_the_scripts():
    assert set(SCRIPTS) == {"zerotune-ds-config", "zerotune-import-config", "zerotune-plan", "zerotune-doctor",
                            "zerotune-builder"}


def test_zerotune_ds_config_prints_the_json():
    proc = run_script("zerotune-ds-config", "zero_stage=3", "offload=cpu")
    assert proc.returncode == 0, proc.stderr
    ds = json.loads(proc.stdout)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_zerotune_plan_prints_the_prediction():
    proc = run_script("zerotune-plan", "--gpu", "rtx4090", "--json", "zero_stage=3")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["gpu_peak_mib"] > 0 and plan["fits"] is True and "ZeRO-3" in plan["workload"]


def test_zerotune_import_config_prints_overrides():
    proc = run_script("zerotune-import-config", str(ROOT / "tests/data/ds_configs/accelerate_reference.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["zero_stage=1", "precision=bf16"]


def test_zerotune_doctor_checks_this_machine(tmp_path):
    proc = run_script("zerotune-doctor", "--json", "--offload-path", str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["offload path"]["status"] == "OK" and checks["offload path"]["details"]["path"] == str(tmp_path)
    assert checks["platform"]["details"]["accelerator"]
    assert proc.returncode == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)


def test_zerotune_builder_serves_the_page_and_a_taken_port_is_a_clear_error(tmp_path):
    log = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115  (closed with the server)
    server = subprocess.Popen([str(BIN / "zerotune-builder"), "--port", "0"], cwd=ROOT, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        first = server.stdout.readline()  # stdout is the URL alone (DeepSpeed's logs go to stderr)
        found = re.search(r"^zerotune config builder: http://127\.0\.0\.1:(\d+)/\?token=[\w-]+$", first.strip())
        assert found, first + (tmp_path / "stderr.txt").read_text()
        with urllib.request.urlopen(first.split()[-1], timeout=60) as page:
            assert page.status == 200 and b"zerotune config builder" in page.read()
        taken = run_script("zerotune-builder", "--port", found.group(1))
        assert taken.returncode == 2 and "cannot listen on 127.0.0.1:" in taken.stderr and "--port 0" in taken.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_zerotune_builder_without_a_token_warns_and_still_checks_the_host(tmp_path):
    log = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115  (closed with the server)
    server = subprocess.Popen([str(BIN / "zerotune-builder"), "--port", "0", "--no-token"], cwd=ROOT, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        first = server.stdout.readline().strip()
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
        server.terminate()
        server.wait(timeout=30)
        log.close()

"""The GPU kit's first call (`bash benchmarks/gpu/run.sh first`): the environment, then the two reference rows
each beside the planner's prediction, planned from the recorded H100 runs to fit 8 minutes; the budget leaves out
what does not fit, with its command; a call killed at its time limit still leaves valid files with every row
done so far. Rehearsed here as a dry run (tiny shapes on the CPU); the estimates are checked against the
records they come from."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import ROOT, cli_env
from zerotune.config import search

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import estimates  # noqa: E402
import kit  # noqa: E402
import parts  # noqa: E402
import report  # noqa: E402
import rows  # noqa: E402

pytestmark = pytest.mark.timeout(600)

RAW = ROOT / estimates.RECORDS / "raw"
GPU_FIGURES = ("gpu_peak_process_mib", "gpu_peak_device_mib", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib",
               "step_time_median_s")


def kit_env(tmp: Path, **extra: str) -> dict:
    """As the suite's autouse fixtures do for each test: no accelerate config or user config folder leaks in."""
    env = {**cli_env(), "OUT": str(tmp / "out"), "GPU_KIT_WORK": str(tmp / "work"), "PYTHON": sys.executable,
           "HF_HOME": str(tmp / "hf_home"), search.CONFIG_DIR_ENV: "", **extra}
    for name in [n for n in env if n.startswith(("ACCELERATE_", "ZEROTUNE_GPU_KIT_"))]:
        if name not in extra:
            del env[name]
    return env


def start_first(env: dict) -> subprocess.Popen:
    return subprocess.Popen(["bash", "benchmarks/gpu/run.sh", "first", "--dry-run"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[dict, str, str]:
    """A whole dry run of `first`: (first.json, first.md, what it printed)."""
    tmp = tmp_path_factory.mktemp("gpu_kit_first")
    proc = start_first(kit_env(tmp))
    printed, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, printed[-6000:]
    out = tmp / "out"
    assert sorted(p.name for p in out.iterdir()) == ["first.json", "first.md"]  # the device tool brings back 8
    return json.loads((out / "first.json").read_text()), (out / "first.md").read_text(), printed


def test_first_measures_the_environment_then_the_two_reference_rows_beside_the_planner(first):
    record, md, printed = first
    assert record["part"] == "first" and record["dry_run"] is True and record["complete"] is True
    assert [e["piece"] for e in record["plan"]] == ["install", "env", "ref_1024_bs8", "ref_128_bs8"]
    assert [e["status"] for e in record["plan"]] == ["done"] * 4
    started = [printed.index(f"gpu kit: first/{name} (") for name in ("env", "ref_1024_bs8", "ref_128_bs8")]
    assert started == sorted(started)
    probe = record["env"]["probe"]
    assert probe["versions"]["deepspeed"] and [u["step"] for u in probe["first_uses"]][-1] == "after_nccl_init"
    assert "cpu_adam" in {op["op"] for op in probe["ops"]}
    assert probe["cpu_adam"]["seconds"] is None and "--no-build" in probe["cpu_adam"]["skipped"]  # the row builds it
    assert [r["name"] for r in record["rows"]] == ["ref_1024_bs8", "ref_128_bs8"]
    for row, experiment in zip(record["rows"], ("sdxl_4090_1024_bs8", "sdxl_4090_128_bs8"), strict=True):
        assert row["status"] == "ok" and f"experiment={experiment}" in row["overrides"], row
        assert row["predicted"]["run_peak_mib"] > 0 and row["predicted"]["phases"]  # the planner, beside each
        assert all(row["measured"][k] is None for k in GPU_FIGURES) and row["ratio"] is None  # no card: unmeasured
        assert [p["phase"] for p in row["phases_torch"]] == ["loading", "step"]
        assert all(p["gpu_max_reserved_mib"] is None and p["seconds"] >= 0 for p in row["phases_torch"])
        assert len(row["step_times_s"]) == 1 and row["ops_build"]["ops"]
    env_at, rows_at = md.index("## Environment"), md.index("## The reference rows")
    assert env_at < rows_at < md.index("| ref_1024_bs8 | ok | ") < md.index("| ref_128_bs8 | ok | ")
    assert "| ref_1024_bs8 | loading | " in md and "| cpu_adam | yes | " in md


def test_the_dry_run_prints_the_card_plan_fitting_8_minutes(first):
    record, md, printed = first
    assert kit.BUDGET_S == 480 and record["budget_s"] == 480
    plan = printed[printed.index("gpu kit: first: plan"):printed.index("gpu kit: first/env (")]
    assert "budget 480 s from the command's start" in plan
    for entry in record["plan"][1:]:  # each piece with its estimated seconds and how they were reached
        assert f"{entry['piece']}" in plan and f"{entry['estimate_s']:.1f} s" in plan
    assert "10 steps x 2.65 s" in plan and "10 steps x 2.93 s" in plan and "CPU-Adam build 92.2 s" in plan
    assert record["plan_total_s"] <= 480 and f"{record['plan_total_s']:.1f} s  of 480 s: fits" in plan
    assert "of 480 s: fits" in md


def test_the_plan_for_a_bare_card_fits_the_budget(tmp_path):
    """The planning code itself, for the card: nothing installed or built yet, every piece at its estimate."""
    part = kit.Part("first", tmp_path, True, report.first_markdown, time.time())
    cpu_adam = kit.CpuAdam(dry_run=True)  # plans the CPU-Adam build, as on a bare machine
    pieces = [kit.env_piece({}, tmp_path, True, False, cpu_adam),
              *kit.row_pieces(part, parts.FIRST, tmp_path, True, cpu_adam, None)]
    seconds = {p.name: p.estimate_s for p in pieces}
    assert list(seconds) == ["env", "ref_1024_bs8", "ref_128_bs8"] and not any(p.skip for p in pieces)
    assert seconds["ref_1024_bs8"] == pytest.approx(estimates.REF_1024_BS8.seconds(10) + estimates.CPU_ADAM_BUILD_S)
    assert seconds["ref_128_bs8"] == pytest.approx(estimates.REF_128_BS8.seconds(10))
    assert sum(seconds.values()) <= kit.BUDGET_S


@pytest.mark.slow  # a first call started and killed mid-row, 24 s; stopping a piece's processes is a fast test below
def test_a_call_killed_mid_row_leaves_valid_files_with_the_rows_done(tmp_path):
    proc = start_first(kit_env(tmp_path))
    path, seen = tmp_path / "out" / "first.json", []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if path.is_file():
                seen.append(json.loads(path.read_text()))  # every version the kit leaves parses
                if seen[-1]["rows"]:
                    break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as the device tool stops a call at its time limit
        proc.communicate()
    assert seen and [e["piece"] for e in seen[0]["plan"]] == ["install", "env", "ref_1024_bs8", "ref_128_bs8"]
    record = json.loads(path.read_text())
    assert record["complete"] is False
    assert [r["name"] for r in record["rows"]] == ["ref_1024_bs8"] and record["rows"][0]["status"] == "ok"
    assert record["env"]["probe"] is not None
    statuses = {e["piece"]: e["status"] for e in record["plan"]}
    assert statuses["ref_1024_bs8"] == "done" and statuses["ref_128_bs8"] in ("running", "planned")
    assert "experiment=sdxl_4090_128_bs8" in record["plan"][-1]["command"]  # what was left, with its command
    md = (tmp_path / "out" / "first.md").read_text()
    assert "INCOMPLETE (stopped early)" in md and "| ref_1024_bs8 | ok | " in md
    # a kill mid-write leaves the unfinished copy beside them (.first.json.partial), never a half file
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == ["first.json",
                                                                                                   "first.md"]


def test_the_budget_leaves_out_the_rows_that_do_not_fit_with_their_commands(tmp_path):
    # 130 s: the env probe's 60 fit; neither row (215 s with the CPU-Adam build, 142 s) fits what is left
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "first", "--dry-run"], cwd=ROOT,
                          env=kit_env(tmp_path, ZEROTUNE_GPU_KIT_BUDGET_S="130"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "first.json").read_text())
    assert record["complete"] is True and record["budget_s"] == 130 and record["env"]["probe"] is not None
    statuses = {e["piece"]: e["status"] for e in record["plan"]}
    assert statuses["env"] == "done"
    for row, experiment in zip(record["rows"], ("sdxl_4090_1024_bs8", "sdxl_4090_128_bs8"), strict=True):
        assert row["status"].startswith("not run: needs about ") and row["status"] == statuses[row["name"]]
        assert f"experiment={experiment}" in row["command"] and "exit_code" not in row
    assert "of 130 s: over by" in proc.stdout
    assert "gpu kit: first/ref_" not in proc.stdout  # neither started
    assert "| ref_128_bs8 | not run: needs about 142 s" in (tmp_path / "out" / "first.md").read_text()


def test_a_piece_that_does_not_fit_is_left_out_and_a_later_one_that_does_still_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_GPU_KIT_BUDGET_S", "100")
    part = kit.Part("grid", tmp_path, True, report.runs_markdown, time.time())
    ran, left_out = [], {}

    def piece(name: str, seconds: float) -> kit.Piece:
        return kit.Piece(name, seconds, "test", f"run {name}", run=lambda limit: ran.append((name, limit)) or "ok",
                         not_run=lambda why: left_out.update({name: why}))

    record = kit.run_plan(part, [piece("a", 30), piece("big", 500), piece("b", 30)],
                          kit.install_entry(part, True, True))
    assert [name for name, _ in ran] == ["a", "b"] and ran[0][1] == pytest.approx(kit.LIMIT_FACTOR * 30)
    assert list(left_out) == ["big"] and left_out["big"].startswith("not run: needs about 500 s")
    on_disk = json.loads((tmp_path / "grid.json").read_text())
    assert [e["status"] for e in on_disk["plan"]] == ["done", "done", left_out["big"], "done"] == \
        [e["status"] for e in record["plan"]]
    assert on_disk["plan"][2]["command"] == "run big" and on_disk["plan_total_s"] == pytest.approx(560, abs=1)


def recorded(call: str, name: str) -> dict:
    part = "grid" if call.startswith("grid") else "reference"
    return next(r for r in json.loads((RAW / call / f"{part}.json").read_text())["rows"] if r["name"] == name)


@pytest.mark.parametrize("cost, call, name", [(estimates.REF_1024_BS8, "call2", "ref_1024_bs8"),
                                              (estimates.REF_128_BS8, "call2", "ref_128_bs8"),
                                              (estimates.REF_1024_BS1, "call2", "ref_1024_bs1_8gib"),
                                              (estimates.PHASES_128_BS8, "call1", "phases_128_bs8_empty_cache")])
def test_a_reference_row_estimate_is_its_recorded_run(cost, call, name):
    row = recorded(call, name)
    assert cost.step_s == pytest.approx(row["measured"]["step_time_median_s"], abs=0.01)
    assert cost.seconds(row["measured"]["steps"]) == pytest.approx(row["wall_s"], abs=0.2)


@pytest.mark.parametrize("name", sorted(estimates.GRID))
def test_a_grid_row_estimate_is_its_recorded_run(name):
    call = next(c for c in ("grid-call1", "grid-call2") if (RAW / c / f"{name}.metrics.jsonl").is_file())
    lines = (RAW / call / f"{name}.metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["perf/step_time_s"] for line in lines]
    cost, built = estimates.GRID[name], estimates.CPU_ADAM_BUILD_S if name == "z2_cpu_512_bs1" else 0.0
    assert cost.step_s == pytest.approx(statistics.mean(steps), abs=0.01)
    assert cost.seconds(len(steps)) + built == pytest.approx(recorded(call, name)["wall_s"], abs=0.2)


def test_the_cpu_adam_build_is_the_same_job_on_a_bare_machine_less_cached():
    kept, cached = recorded("call1", "phases_128_bs8_kept"), recorded("call1", "phases_128_bs8_empty_cache")
    assert estimates.CPU_ADAM_BUILD_S == pytest.approx(kept["wall_s"] - cached["wall_s"], abs=0.1)


def test_a_piece_at_its_limit_is_stopped_with_every_process_it_started(tmp_path):
    # the grandchild holds the output pipe, as a job's workers do: the kit must not wait the minute out
    started = time.monotonic()
    exit_code, output = rows.run_bounded(
        [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); print('up', flush=True); "
                               "time.sleep(60)"], tmp_path, None, 3)
    assert exit_code is None and output.startswith("killed after 3 s\nup")
    assert time.monotonic() - started < 30

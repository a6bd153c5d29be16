"""Sweep reports: collection, summary.csv / summary.md, plots, budget answer, CLI and Hydra callback.

Every summary.json below is a TEST FIXTURE, hand-written to exercise the aggregation: the numbers are
made up and are not measurements of anything.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from PIL import Image

from tests.helpers.cli import call_main, cli_env
from zerotune.cli.callbacks import SweepReportCallback
from zerotune.cli.report import main as report_main
from zerotune.report.budget import budget_answer, cheapest_fit
from zerotune.report.build import build_report
from zerotune.report.collect import NoRunsError, collect_runs, swept_keys
from zerotune.report.plots import GPU_PNG, HOST_PNG, TIME_PNG

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OLD = time.time() - 3600  # mtime for a job folder that stopped changing long ago: "missing", not "running"
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------- fixtures (made-up numbers, not measurements)

def write_job(sweep: Path, num: int, *, stage: int, resolution: int, status: str = "ok", batch: int = 8,
              offload: str = "none", gpu: float | None = None, host: float | None = 3000.0,
              step: float | None = 0.5, error: dict | None = None, experiment: dict | None = None,
              device: str = "FIXTURE-GPU", gpu_max_rank: float | None = None, summary: bool = True) -> Path:
    """A job folder as a sweep leaves it: .hydra/overrides.yaml always, summary.json unless told not."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(
        f"- zero_stage='{stage}'\n- offload={offload}\n- resolution='{resolution}'\n"
        f"- train.batch_size={batch}\n")
    if summary:
        data = {
            "status": status,
            "choices": {"zero_stage": stage, "offload": offload, "optimizer": "adamw", "scheduler": "warmup",
                        "resolution": resolution, "batch_size": batch, "grad_accum": 1, "precision": "bf16",
                        "model": "tiny", "data": "synthetic", "gradient_checkpointing": False,
                        "world_size": 1},
            "steps": 30 if status == "ok" else 3, "loss_first": 1.0,
            "loss_last": 0.25 if status == "ok" else None,
            "wall_time_s": 60.0,
            "memory": {"gpu_peak_process_mib": gpu, "gpu_peak_device_mib": gpu,
                       "gpu_peak_allocated_mib": None if gpu is None else gpu - 1000,
                       "gpu_peak_reserved_mib": None if gpu is None else gpu - 500,
                       "host_peak_rss_mib": host, "nvme_peak_mib": None,
                       "gpu_peak_process_mib_max_rank": gpu_max_rank},
            "perf": {"step_time_median_s": step, "step_time_p90_s": None if step is None else step * 1.2,
                     "samples_per_s": None if step is None else batch / step, "startup_s": 12.0},
            "env": {"device_name": device},
        }
        if error:
            data["error"] = error
        if experiment:
            data["experiment"] = experiment
        (job / "summary.json").write_text(json.dumps(data))
    else:
        for p in (job / ".hydra" / "overrides.yaml", job / ".hydra", job):
            os.utime(p, (OLD, OLD))
    return job


OOM = {"type": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail",
       "traceback_tail": ["..."]}
FAILED = {"type": "ValueError", "message": "bad | value"}
REFERENCE = {"name": "fixture-reference",
             "reference": {"gpu_peak_process_mib": 16000.0, "step_time_s": 0.9, "device": "FIXTURE-REF-GPU",
                           "source": "fixture guide"}}


@pytest.fixture
def gpu_sweep(tmp_path: Path) -> Path:
    """2 stages x 2 resolutions (stage 2 @ 512 OOMs), a failed job and a job that left no summary.json."""
    sweep = tmp_path / "multirun" / "2026-11-21" / "21-40-00-000001"
    write_job(sweep, 0, stage=2, resolution=128, gpu=6000.0, host=3000.0, step=0.40)
    write_job(sweep, 1, stage=2, resolution=512, status="oom", gpu=None, host=3100.0, step=None, error=OOM)
    # Two ranks: rank 0 peaked at 4000 MiB, the busiest rank at 4200 MiB.
    write_job(sweep, 2, stage=3, resolution=128, gpu=4000.0, gpu_max_rank=4200.0, host=3500.0, step=0.60)
    write_job(sweep, 3, stage=3, resolution=512, gpu=20000.0, host=4000.0, step=1.50, experiment=REFERENCE)
    write_job(sweep, 4, stage=2, resolution=1024, status="failed", gpu=None, host=2000.0, step=None,
              error=FAILED)
    write_job(sweep, 5, stage=3, resolution=1024, summary=False)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")  # Hydra's own file beside the jobs: not a job
    return sweep


@pytest.fixture
def cpu_sweep(tmp_path: Path) -> Path:
    """The same grid on a machine without a GPU: every GPU figure is null."""
    sweep = tmp_path / "multirun" / "2026-11-22" / "09-00-00-000002"
    write_job(sweep, 0, stage=2, resolution=128, host=3000.0, step=0.9)
    write_job(sweep, 1, stage=2, resolution=512, host=5000.0, step=2.0)
    write_job(sweep, 2, stage=3, resolution=128, host=2500.0, step=1.2)
    write_job(sweep, 3, stage=3, resolution=512, status="oom", host=None, step=None, error=OOM)
    return sweep


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.size[0] > 300 and img.size[1] > 150


def by_job(rows: list[dict]) -> dict[str, dict]:
    return {r["job"]: r for r in rows}


# ---------------------------------------------------------------- collection

def test_collect_reads_every_job_state(gpu_sweep: Path):
    with open(gpu_sweep / "0" / ".hydra" / "overrides.yaml", "a") as f:
        f.write("- report.budget_mib=100\n")  # configures the report, not the run: never a swept key
    rows = by_job(collect_runs([gpu_sweep]))
    assert list(rows) == ["0", "1", "2", "3", "4", "5"]
    assert {j: r["status"] for j, r in rows.items()} == {
        "0": "ok", "1": "oom", "2": "ok", "3": "ok", "4": "failed", "5": "missing"}
    assert rows["0"]["gpu_peak_process_mib"] == 6000.0 and rows["1"]["gpu_peak_process_mib"] is None
    assert rows["2"]["gpu_peak_process_mib"] == 4200.0  # the busiest rank's peak is what must fit a GPU
    assert rows["1"]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    # The missing job is still placed by its overrides (quoted group choices parsed back to numbers).
    assert rows["5"]["params"]["zero_stage"] == 3 and rows["5"]["params"]["resolution"] == 1024
    assert rows["5"]["step_time_median_s"] is None
    assert all(r["sweep_dir"] == str(gpu_sweep) for r in rows.values())
    assert swept_keys(list(rows.values())) == ["zero_stage", "resolution"]


def test_collect_running_job_and_single_run_dir(gpu_sweep: Path):
    fresh = gpu_sweep / "6"
    (fresh / ".hydra").mkdir(parents=True)
    (fresh / ".hydra" / "overrides.yaml").write_text("- zero_stage='3'\n")
    statuses = {r["job"]: r["status"] for r in collect_runs([gpu_sweep])}
    assert statuses["6"] == "running" and statuses["5"] == "missing"
    assert {r["job"]: r["status"] for r in collect_runs([gpu_sweep], running_window_s=0)}["6"] == "missing"

    single = collect_runs([gpu_sweep / "2"])
    assert len(single) == 1 and single[0]["job"] == "2" and single[0]["sweep_dir"] == str(gpu_sweep)


def test_collect_refuses_missing_and_empty_dirs(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        collect_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoRunsError):
        collect_runs([tmp_path / "empty"])


# ---------------------------------------------------------------- tables and plots

def test_csv_markdown_and_plots_with_gpu_figures(gpu_sweep: Path, tmp_path: Path):
    out = tmp_path / "report"
    report = build_report([gpu_sweep], out=out)

    rows = read_csv(out / "summary.csv")
    assert list(rows[0]) == [
        "sweep_dir", "job", "zero_stage", "resolution", "status", "gpu_peak_process_mib",
        "gpu_peak_allocated_mib",
        "gpu_peak_reserved_mib", "host_peak_rss_mib", "nvme_peak_mib", "step_time_median_s", "samples_per_s",
        "startup_s", "loss_last", "error"]
    # Sorted by the swept keys: stage, then resolution.
    assert [(r["zero_stage"], r["resolution"], r["job"]) for r in rows] == [
        ("2", "128", "0"), ("2", "512", "1"), ("2", "1024", "4"), ("3", "128", "2"), ("3", "512", "3"),
        ("3", "1024", "5")]
    first, oom, failed, missing = rows[0], rows[1], rows[2], rows[5]
    assert float(first["gpu_peak_process_mib"]) == 6000.0 and float(first["gpu_peak_allocated_mib"]) == 5000.0
    assert float(first["gpu_peak_reserved_mib"]) == 5500.0 and float(first["host_peak_rss_mib"]) == 3000.0
    assert float(first["step_time_median_s"]) == 0.4 and float(first["samples_per_s"]) == 20.0
    assert float(first["startup_s"]) == 12.0 and float(first["loss_last"]) == 0.25 and first["error"] == ""
    assert first["nvme_peak_mib"] == ""  # null stays empty, never 0
    assert oom["status"] == "oom" and oom["gpu_peak_process_mib"] == ""
    assert oom["error"].startswith("OutOfMemoryError")
    assert failed["error"] == "ValueError: bad | value"
    assert missing["status"] == "missing" and missing["host_peak_rss_mib"] == ""

    md = (out / "summary.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert table[0].startswith("| job | zero_stage | resolution | status | GPU peak MiB |")
    assert [line.split(" | ")[0].removeprefix("| ") for line in table[1:7]] == ["0", "1", "4", "2", "3", "5"]
    assert "| 0 | 2 | 128 | ok | 6000 | 5000 | 5500 | 3000 | n/a | 0.4 | 20 | 12.0 | 0.2500 |  |" in md
    assert "| 1 | 2 | 512 | oom | n/a |" in md
    assert "bad \\| value" in md  # a pipe in an error message doesn't break the table
    assert "1 failed, 1 missing, 3 ok, 1 oom" in md
    assert report.table_md in md

    # Measured vs reference: memory as a ratio, time side by side with each device named.
    assert "## Measured vs reference" in md
    ref_line = next(line for line in md.splitlines() if line.startswith("| fixture-reference"))
    assert "| 20000 | 16000 | 1.25× |" in ref_line
    assert "| 1.5 s (FIXTURE-GPU) | 0.9 s (FIXTURE-REF-GPU) | fixture guide |" in ref_line

    assert [p.path.name for p in report.plots] == [GPU_PNG, TIME_PNG, HOST_PNG]
    assert all(p.note is None for p in report.plots)
    for name in (GPU_PNG, TIME_PNG, HOST_PNG):
        assert_png(out / name)


def test_plots_take_a_list_valued_override(tmp_path: Path):
    """A tune trial overrides validation.prompts=[]: in a one-job sweep it identifies the line, and the plots
    once failed on it (unhashable list), leaving the sweep without a report."""
    sweep = tmp_path / "sweep"
    job = write_job(sweep, 0, stage=2, resolution=128, gpu=6000.0, step=0.4)
    overrides = job / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text() + "- validation.prompts=[]\n- validation.prompt_file=null\n")
    report = build_report([sweep])
    assert [p.note for p in report.plots] == [None, None, None]
    for plot in report.plots:
        assert_png(plot.path)
    assert "validation.prompts" in report.keys


def test_all_null_gpu_is_unmeasured_not_zero(cpu_sweep: Path):
    report = build_report([cpu_sweep])  # default --out: the sweep directory itself
    rows = read_csv(cpu_sweep / "summary.csv")
    assert len(rows) == 4
    assert all(r[k] == "" for r in rows for k in ("gpu_peak_process_mib", "gpu_peak_allocated_mib",
                                                  "gpu_peak_reserved_mib"))
    assert [float(r["host_peak_rss_mib"]) for r in rows if r["status"] == "ok"] == [3000.0, 5000.0, 2500.0]

    gpu_plot = report.plots[0]
    assert gpu_plot.note == "GPU memory unmeasured (no GPU)"
    assert report.plots[1].note is None and report.plots[2].note is None
    md = (cpu_sweep / "summary.md").read_text()
    assert "GPU memory unmeasured (no GPU)" in md
    assert "| 0 | 2 | 128 | ok | n/a | n/a | n/a | 3000 |" in md
    assert "Measured vs reference" not in md  # no fixture here carries a reference
    for name in (GPU_PNG, TIME_PNG, HOST_PNG):
        assert_png(cpu_sweep / name)


def test_merging_two_sweeps(gpu_sweep: Path, cpu_sweep: Path, tmp_path: Path):
    rows = collect_runs([gpu_sweep, cpu_sweep])
    assert len(rows) == 10
    assert {(r["sweep_dir"], r["job"]) for r in rows if r["job"] == "0"} == {
        (str(gpu_sweep), "0"), (str(cpu_sweep), "0")}
    # A folder of sweeps (multirun/) expands to the sweeps in it.
    nested = collect_runs([gpu_sweep.parents[1]])
    assert [(r["sweep_dir"], r["job"]) for r in nested] == [(r["sweep_dir"], r["job"]) for r in rows]

    build_report([gpu_sweep, cpu_sweep], out=tmp_path / "merged")
    csv_rows = read_csv(tmp_path / "merged" / "summary.csv")
    assert len(csv_rows) == 10
    assert sum(r["sweep_dir"] == str(cpu_sweep) for r in csv_rows) == 4
    md = (tmp_path / "merged" / "summary.md").read_text()
    assert "| sweep | job | zero_stage | resolution |" in md
    assert "| 2026-11-22/09-00-00-000002 | 0 | 2 | 128 | ok |" in md


# ---------------------------------------------------------------- budget

def test_budget_picks_fastest_that_fits(gpu_sweep: Path):
    rows = collect_runs([gpu_sweep])
    best = cheapest_fit(rows, 24576)
    assert best is not None and best["job"] == "0"  # 0.40 s/step beats 0.60 and 1.50, all fit
    assert best["fit"]["peak_mib"] == 6000.0 and best["fit"]["headroom_mib"] == 18576.0
    assert cheapest_fit(rows, 5000)["job"] == "2"  # only the 4200 MiB job fits
    assert cheapest_fit(rows, 4200)["job"] == "2"  # the budget is inclusive

    none = budget_answer(rows, 4100)  # rank 0 of job 2 would fit; its busiest rank doesn't
    assert none.best is None and cheapest_fit(rows, 4100) is None
    assert "smallest measured peak is 4200 MiB" in none.reason and "1 oom" in none.reason

    # Fitting jobs at two resolutions: their s/step are different work, and the answer says so.
    assert "differ in resolution" in budget_answer(rows, 24576).reason
    at_512 = budget_answer(rows, 24576, where={"resolution": 512})
    assert at_512.best["job"] == "3" and at_512.reason.startswith("Among jobs with resolution=512: ")
    assert "differ in" not in at_512.reason
    assert cheapest_fit(rows, 24576, where={"train.batch_size": 8})["job"] == "0"  # override spelling works
    assert budget_answer(rows, 24576, where={"resolution": 64}).reason == "No job has resolution=64."

    host = cheapest_fit(rows, 3200, metric="host_peak_rss_mib")  # only job 0 (3000 MiB host) fits
    assert host is not None and host["job"] == "0" and host["fit"]["metric"] == "host_peak_rss_mib"


def test_budget_never_counts_null_gpu_as_fitting(cpu_sweep: Path, gpu_sweep: Path):
    rows = collect_runs([cpu_sweep])
    answer = budget_answer(rows, 10**9)
    assert answer.best is None and "Could not decide from GPU figures" in answer.reason
    assert "--metric host" in answer.reason
    assert cheapest_fit(rows, 10**9) is None
    assert cheapest_fit(rows, 4000, metric="host")["job"] == "0"  # fastest of the two that fit 4000 MiB

    # Mixed: the fastest ok job has no GPU figure, so the measured one is chosen and the other is named.
    mixed = collect_runs([gpu_sweep, cpu_sweep])
    for r in mixed:
        if r["sweep_dir"] == str(cpu_sweep):
            r["step_time_median_s"] = 0.01
    answer = budget_answer(mixed, 10**9)
    assert answer.best["sweep_dir"] == str(gpu_sweep) and answer.best["job"] == "0"
    assert "3 ok job(s) have no gpu_peak_process_mib figure" in answer.reason


def test_budget_ties_prefer_lower_memory(tmp_path: Path):
    sweep = tmp_path / "ties"
    write_job(sweep, 0, stage=2, resolution=128, gpu=9000.0, step=1.000)
    write_job(sweep, 1, stage=3, resolution=128, gpu=5000.0, step=1.010)  # within 2%: a tie
    write_job(sweep, 2, stage=3, resolution=256, gpu=4000.0, step=1.500)
    answer = budget_answer(collect_runs([sweep]), 10000)
    assert answer.best["job"] == "1"
    assert [t["job"] for t in answer.ties] == ["0"]
    assert "Tied within 2%" in answer.reason and "lowest peak memory" in answer.reason


def test_budget_rejects_bad_input(gpu_sweep: Path):
    rows = collect_runs([gpu_sweep])
    with pytest.raises(ValueError, match="unknown memory metric"):
        budget_answer(rows, 1000, metric="vram")
    with pytest.raises(ValueError, match="positive"):
        budget_answer(rows, 0)


# ---------------------------------------------------------------- CLI

def run_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotune", "report", *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_report_and_answers_budget(gpu_sweep: Path, tmp_path: Path):
    out = tmp_path / "cli-out"
    proc = run_report(str(gpu_sweep), "--budget-mib", "5000", "--where", "resolution=128", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| job | zero_stage | resolution | status |" in proc.stdout
    assert ("Among jobs with resolution=128: Fastest that fits 5000 MiB of gpu_peak_process_mib: "
            "zero_stage=3 (job 2)" in proc.stdout)
    assert {p.name for p in out.iterdir()} == {"summary.csv", "summary.md", GPU_PNG, TIME_PNG, HOST_PNG}
    assert "## Budget: 5000 MiB of gpu_peak_process_mib" in (out / "summary.md").read_text()


def test_cli_exit_codes_for_bad_paths(gpu_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    # The usage errors in-process (the module's entry point, without an interpreter start each; its process:
    # test_cli_writes_report_and_answers_budget).
    missing = call_main(report_main, str(gpu_sweep), str(tmp_path / "no-such-sweep"))
    assert missing.returncode == 2
    assert "argument DIR" in missing.stderr and "no-such-sweep does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    for argv, message in [([str(tmp_path / "empty")], "holds no runs"),
                          ([str(gpu_sweep), "--budget-mib", "-5"], "argument --budget-mib"),
                          ([str(gpu_sweep), "--budget-mib", "100", "--where", "resolution"], "argument --where")]:
        with pytest.raises(SystemExit) as exited:
            report_main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "empty" / "summary.md").exists()


# ---------------------------------------------------------------- Hydra callback

def test_callback_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    callback = SweepReportCallback()
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken"
    (broken / "0").mkdir(parents=True)
    (broken / "0" / "summary.json").write_text("{ not json")
    (broken / "1").mkdir()
    (broken / "1" / "summary.json").write_text("[1, 2]")
    with caplog.at_level(logging.INFO, logger="zerotune.cli.callbacks"):
        callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "empty")}}}))
        callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "gone")}}}))
        callback.on_multirun_end(OmegaConf.create({"no_hydra_node": 1}))
        callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(broken)}},
                                                   "report": {"budget_mib": "lots"}}))
        callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(broken)}}}))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("sweep report skipped" in m for m in messages) == 2
    assert sum("failed (the sweep itself is unaffected)" in m for m in messages) == 2
    # Unreadable summaries are reported as missing jobs, not a crash.
    assert {r["status"] for r in read_csv(broken / "summary.csv")} == {"missing"}


def test_callback_refreshes_at_job_ends_within_its_share_of_the_time(gpu_sweep: Path, monkeypatch):
    """Short jobs do not each pay a rebuild: after one that took 0.3 s, the job ends within 15 s skip it (0.3 s
    is 2% of that); one after that rebuilds, and the sweep's end always does."""
    from zerotune.cli import callbacks

    clock = [100.0]
    built: list[float] = []

    def timed_build(*args, **kwargs):
        built.append(clock[0])
        clock[0] += 0.3  # what a rebuild costs
        return build_report(*args, **kwargs)

    monkeypatch.setattr("zerotune.report.build.build_report", timed_build)
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: clock[0])
    from hydra.core.utils import JobStatus
    from hydra.types import RunMode

    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(gpu_sweep)}, "mode": RunMode.MULTIRUN}})
    callback = SweepReportCallback()
    for advance in (0.0, 4.0, 4.0, 4.0, 4.0):  # five job ends, 4 s apart
        clock[0] += advance
        callback.on_job_end(cfg)
    assert callbacks.REFRESH_SHARE == 0.02
    assert built == [100.0, 116.3]  # the first; then the first end 15 s (0.3 / 2%) after the first rebuild
    clock[0] += 1.0
    callback.on_job_end(cfg, SimpleNamespace(status=JobStatus.FAILED))  # Hydra ends the sweep after this one
    assert len(built) == 3
    callback.on_multirun_end(cfg)
    assert len(built) == 4 and (gpu_sweep / "summary.md").is_file()


def test_callback_reports_with_budget_from_config(gpu_sweep: Path):
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(gpu_sweep)}}, "report": {"budget_mib": 24576}})
    SweepReportCallback().on_multirun_end(cfg)
    md = (gpu_sweep / "summary.md").read_text()
    assert "## Budget: 24576 MiB of gpu_peak_process_mib" in md
    assert "zero_stage=2, resolution=128 (job 0)" in md

    cfg.report.where = {"resolution": 512}
    SweepReportCallback().on_multirun_end(cfg)
    assert "Among jobs with resolution=512: Fastest" in (gpu_sweep / "summary.md").read_text()


TOY_APP = """
import json, os, sys
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(config_path=".", config_name="cfg", version_base="1.3")
def main(cfg):
    out = HydraConfig.get().runtime.output_dir
    failed = cfg.zero_stage == 3  # made-up outcome, a fixture: stage 3 "fails" like a job that raised
    summary = {"status": "failed" if failed else "ok",
               "choices": {"zero_stage": cfg.zero_stage, "offload": "none", "resolution": 16,
                           "batch_size": 1},
               "memory": {"gpu_peak_process_mib": None, "host_peak_rss_mib": 100.0 * cfg.zero_stage},
               "perf": {"step_time_median_s": 0.1}}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f)
    if failed:
        raise RuntimeError("fixture failure")

main()
"""
TOY_CFG = """
zero_stage: 1
report:
  budget_mib: 1000
  metric: host
hydra:
  sweep:
    dir: sweeps/${now:%H-%M-%S-%f}
  callbacks:
    sweep_report:
      _target_: zerotune.cli.callbacks.SweepReportCallback
"""


def test_callback_in_a_real_hydra_sweep_with_a_failing_job(tmp_path: Path):
    """Hydra re-raises a failed job and skips on_multirun_end; on_job_end has the report written anyway."""
    (tmp_path / "app.py").write_text(TOY_APP)
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent(TOY_CFG))
    proc = subprocess.run([sys.executable, "app.py", "-m", "zero_stage=1,2,3"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "fixture failure" in proc.stderr
    [sweep] = list((tmp_path / "sweeps").iterdir())
    rows = {r["job"]: r for r in read_csv(sweep / "summary.csv")}
    assert {j: r["status"] for j, r in rows.items()} == {"0": "ok", "1": "ok", "2": "failed"}
    assert "Fastest that fits 1000 MiB of host_peak_rss_mib" in (sweep / "summary.md").read_text()

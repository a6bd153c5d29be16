"""Sweep reports with the planner's predictions: plan_* row keys, predicted and ratio columns, and budget
answers that fall back on predicted figures (and say so).

Every summary.json below is a TEST FIXTURE, hand-written to exercise the aggregation: the numbers are
made up and are neither measurements nor predictions of anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_report import read_csv, write_job
from zerotune.cli.report import main as report_main
from zerotune.report.budget import budget_answer, cheapest_fit
from zerotune.report.build import build_report
from zerotune.report.collect import collect_runs


def plan(gpu: float | None = 5000.0, host: float | None = 4000.0, nvme: float | None = 0.0,
         floor: float | None = 0.25) -> dict:
    return {"gpu_peak_mib": gpu, "host_peak_mib": host, "nvme_mib": nvme, "time_floor_s": floor,
            "bound": None if floor is None else "compute", "fits": True,
            "gpu": {"name": "FIXTURE-GPU", "memory_mib": 24564}, "workload": "fixture", "gpu_terms": []}


def with_plan(job: Path, planned: dict) -> Path:
    """Add a `plan` object to the job's summary.json, as the launcher now writes it."""
    file = job / "summary.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "plan": planned}))
    return job


def planned_job(sweep: Path, num: int, *, stage: int, resolution: int, planned: dict) -> Path:
    """A plan.only=true job: status planned, the plan, no memory or perf figures."""
    job = write_job(sweep, num, stage=stage, resolution=resolution)
    data = json.loads((job / "summary.json").read_text())
    data.update(status="planned", plan=planned, steps=None, loss_first=None, loss_last=None, wall_time_s=None)
    for key in ("memory", "perf"):
        del data[key]
    (job / "summary.json").write_text(json.dumps(data))
    return job


@pytest.fixture
def plan_sweep(tmp_path: Path) -> Path:
    """Measured only (old run), measured + plan, planned only, planner failed (ok run and planned job)."""
    sweep = tmp_path / "multirun" / "2026-12-01" / "10-00-00-000001"
    write_job(sweep, 0, stage=2, resolution=128, gpu=6000.0, host=3000.0, step=0.40)
    with_plan(write_job(sweep, 1, stage=2, resolution=256, gpu=5500.0, host=4400.0, step=0.50),
              plan(gpu=5000.0, host=4000.0, nvme=0.0, floor=0.25))
    planned_job(sweep, 2, stage=3, resolution=128, planned=plan(gpu=3000.0, host=9000.0, nvme=1024.0, floor=0.2))
    with_plan(write_job(sweep, 3, stage=3, resolution=256, gpu=4000.0, step=0.6),
              {"error": "KeyError: 'unet'\nmore lines"})
    planned_job(sweep, 4, stage=3, resolution=512, planned={"error": "ValueError: unknown card"})
    return sweep


def by_job(rows: list[dict]) -> dict[str, dict]:
    return {r["job"]: r for r in rows}


PLAN_ROW_KEYS = ("plan_gpu_peak_mib", "plan_host_peak_mib", "plan_nvme_mib", "plan_time_floor_s")


def test_collect_reads_the_plan(plan_sweep: Path):
    rows = by_job(collect_runs([plan_sweep]))
    assert [rows["0"][k] for k in PLAN_ROW_KEYS] == [None] * 4  # an old run: unpredicted, never 0
    assert rows["0"]["plan_error"] is None
    assert [rows["1"][k] for k in PLAN_ROW_KEYS] == [5000.0, 4000.0, 0.0, 0.25]  # a predicted 0 stays 0
    planned = rows["2"]
    assert planned["status"] == "planned" and planned["gpu_peak_process_mib"] is None
    assert planned["step_time_median_s"] is None and planned["plan_gpu_peak_mib"] == 3000.0
    assert [rows["3"][k] for k in PLAN_ROW_KEYS] == [None] * 4
    assert rows["3"]["plan_error"] == "KeyError: 'unet'" and rows["3"]["gpu_peak_process_mib"] == 4000.0
    assert rows["4"]["plan_error"] == "ValueError: unknown card"


def test_collect_ignores_plan_values_that_are_not_figures(tmp_path: Path):
    sweep = tmp_path / "odd"
    with_plan(write_job(sweep, 0, stage=2, resolution=128, gpu=1.0),
              {"gpu_peak_mib": True, "host_peak_mib": "lots", "time_floor_s": None})  # nvme_mib absent
    with_plan(write_job(sweep, 1, stage=2, resolution=256, gpu=1.0), ["not", "an", "object"])
    rows = collect_runs([sweep])
    assert all(r[k] is None for r in rows for k in PLAN_ROW_KEYS)
    assert all(r["plan_error"] is None for r in rows)


def test_tables_show_predictions_beside_measurements(plan_sweep: Path, tmp_path: Path):
    out = tmp_path / "report"
    build_report([plan_sweep], out=out)
    rows = read_csv(out / "summary.csv")
    assert list(rows[0])[4:] == [
        "status", "gpu_peak_process_mib", "plan_gpu_peak_mib", "gpu_peak_measured_over_predicted",
        "gpu_peak_allocated_mib", "gpu_peak_reserved_mib", "host_peak_rss_mib", "plan_host_peak_mib",
        "host_peak_measured_over_predicted", "nvme_peak_mib", "plan_nvme_mib", "step_time_median_s",
        "plan_time_floor_s", "step_time_over_floor", "samples_per_s", "startup_s", "loss_last", "error",
        "plan_error"]
    csv_rows = {r["job"]: r for r in rows}
    both = csv_rows["1"]
    assert float(both["gpu_peak_measured_over_predicted"]) == 1.1  # 5500 / 5000
    # a GPU plan's host figure is not a prediction of the processes' RSS: no host ratio
    # (tests/test_plan_process.py: a process-RSS plan gets one)
    assert both["host_peak_measured_over_predicted"] == ""
    assert float(both["step_time_over_floor"]) == 2.0  # 0.50 / 0.25
    assert float(both["plan_nvme_mib"]) == 0.0
    old = csv_rows["0"]  # measured, no plan: predicted and ratio cells blank
    assert old["plan_gpu_peak_mib"] == "" and old["gpu_peak_measured_over_predicted"] == ""
    assert float(old["gpu_peak_process_mib"]) == 6000.0
    planned = csv_rows["2"]  # predicted, not run: measured and ratio cells blank
    assert planned["status"] == "planned" and float(planned["plan_gpu_peak_mib"]) == 3000.0
    assert planned["gpu_peak_process_mib"] == "" and planned["gpu_peak_measured_over_predicted"] == ""
    assert planned["step_time_median_s"] == "" and float(planned["plan_time_floor_s"]) == 0.2
    assert csv_rows["3"]["plan_error"] == "KeyError: 'unet'" and csv_rows["3"]["step_time_over_floor"] == ""

    md = (out / "summary.md").read_text()
    assert ("| job | zero_stage | resolution | status | GPU peak MiB | pred. GPU MiB | GPU meas/pred | alloc MiB |"
            in md)
    assert ("| 1 | 2 | 256 | ok | 5500 | 5000 | 1.10 | 4500 | 5000 | 4400 | 4000 | - | n/a | 0 | 0.5 | 0.25 "
            "| 2.00 |" in md)
    assert ("| 2 | 3 | 128 | planned | n/a | 3000 | n/a | n/a | n/a | n/a | 9000 | n/a | n/a | 1024 | n/a | 0.2 "
            "| n/a |" in md)
    assert md.count("KeyError: 'unet'") == 1 and "3 ok, 2 planned" in md
    assert "pred. = the planner's prediction" in md


def test_tables_without_any_plan_keep_their_columns(tmp_path: Path):
    sweep = tmp_path / "old"
    write_job(sweep, 0, stage=2, resolution=128, gpu=6000.0)
    write_job(sweep, 1, stage=3, resolution=128, gpu=5000.0)
    build_report([sweep])
    assert not any(c.startswith("plan_") or "predicted" in c for c in read_csv(sweep / "summary.csv")[0])
    assert "pred." not in (sweep / "summary.md").read_text()


# ---------------------------------------------------------------- budget


def test_budget_from_planned_jobs_uses_predictions_and_says_so(tmp_path: Path):
    sweep = tmp_path / "planned"
    planned_job(sweep, 0, stage=2, resolution=128, planned=plan(gpu=9000.0, floor=0.2))
    planned_job(sweep, 1, stage=3, resolution=128, planned=plan(gpu=5000.0, floor=0.3))
    planned_job(sweep, 2, stage=3, resolution=256, planned={"error": "planner failed"})
    rows = collect_runs([sweep])
    best = cheapest_fit(rows, 10000)
    assert best["job"] == "0" and best["fit"]["source"] == "predicted"  # the lower floor wins
    assert best["fit"]["peak_mib"] == 9000.0 and best["fit"]["headroom_mib"] == 1000.0
    reason = best["fit"]["reason"]
    assert "by predicted figures" in reason and "predicted peak 9000 MiB" in reason
    assert "0.2 s/step time floor (a lower bound from the planner, not a measurement)" in reason
    assert "2 of 2 job(s) with only predicted figures fit" in reason
    assert "No ok job has a measured gpu_peak_process_mib" in reason
    assert "1 planned job(s) (not run) have no predicted gpu_peak_process_mib" in reason

    small = budget_answer(rows, 6000)
    assert small.best["job"] == "1" and small.source == "predicted"
    none = budget_answer(rows, 1000)
    assert none.best is None and cheapest_fit(rows, 1000) is None
    assert "No job finished with status ok" in none.reason
    assert "By predicted figures nothing fits either: the smallest predicted peak is 5000 MiB" in none.reason


def test_budget_on_a_cpu_only_sweep_falls_back_to_predicted_gpu_figures(tmp_path: Path):
    sweep = tmp_path / "cpu"
    with_plan(write_job(sweep, 0, stage=2, resolution=128, host=3000.0, step=0.9), plan(gpu=9000.0, floor=0.1))
    with_plan(write_job(sweep, 1, stage=3, resolution=128, host=2500.0, step=1.2), plan(gpu=6000.0, floor=0.15))
    rows = collect_runs([sweep])
    gpu = cheapest_fit(rows, 8000)
    assert gpu["job"] == "1" and gpu["fit"]["source"] == "predicted" and gpu["fit"]["peak_mib"] == 6000.0
    assert "No ok job has a measured gpu_peak_process_mib (no GPU present)" in gpu["fit"]["reason"]
    assert "time floor" in gpu["fit"]["reason"]
    # Host RSS was measured on that machine: measured figures answer, as before.
    host = cheapest_fit(rows, 4000, metric="host")
    assert host["job"] == "0" and host["fit"]["source"] == "measured" and host["fit"]["peak_mib"] == 3000.0
    assert "predicted" not in host["fit"]["reason"]


def test_budget_mixed_measured_comes_first_predicted_named(tmp_path: Path):
    """A measured job and a never-run planned job compete: a floor is a lower bound, not a speed."""
    sweep = tmp_path / "mixed"
    with_plan(write_job(sweep, 0, stage=2, resolution=128, gpu=7000.0, step=0.5), plan(gpu=6500.0, floor=0.2))
    planned_job(sweep, 1, stage=3, resolution=128, planned=plan(gpu=4000.0, floor=0.1))
    write_job(sweep, 2, stage=3, resolution=256, status="oom", gpu=None, step=None)
    rows = collect_runs([sweep])

    roomy = budget_answer(rows, 8000)
    assert roomy.best["job"] == "0" and roomy.source == "measured"
    assert cheapest_fit(rows, 8000)["fit"]["source"] == "measured"
    assert roomy.reason.startswith("Fastest that fits 8000 MiB of gpu_peak_process_mib: zero_stage=2, resolution=128 "
                                   "(job 0) at 0.5 s/step (median), peak 7000 MiB")
    assert "1 job(s) have only predicted figures (1 fit by prediction)" in roomy.reason
    assert "zero_stage=3, resolution=128 (job 1) has a predicted time floor of 0.1 s/step" in roomy.reason
    assert "Did not finish ok: 1 oom." in roomy.reason

    # The measured job no longer fits; the planned one does by prediction.
    tight = cheapest_fit(rows, 5000)
    assert tight["job"] == "1" and tight["fit"]["source"] == "predicted" and tight["fit"]["peak_mib"] == 4000.0
    assert "No measured job fits: the smallest measured peak is 7000 MiB." in tight["fit"]["reason"]
    assert "Did not finish ok: 1 oom." in tight["fit"]["reason"]


def test_budget_predicted_ties_prefer_lower_predicted_peak(tmp_path: Path):
    sweep = tmp_path / "ties"
    planned_job(sweep, 0, stage=2, resolution=128, planned=plan(gpu=9000.0, floor=1.000))
    planned_job(sweep, 1, stage=3, resolution=128, planned=plan(gpu=5000.0, floor=1.010))
    answer = budget_answer(collect_runs([sweep]), 10000)
    assert answer.best["job"] == "1" and [t["job"] for t in answer.ties] == ["0"]
    assert "Tied within 2% on time floor" in answer.reason and "lowest predicted peak memory" in answer.reason


def test_budget_where_a_prediction_has_no_time_floor(tmp_path: Path):
    sweep = tmp_path / "nofloor"
    planned_job(sweep, 0, stage=2, resolution=128, planned=plan(gpu=3000.0, floor=None))
    answer = budget_answer(collect_runs([sweep]), 10000)
    assert answer.best is None and "the planner gave none a time floor" in answer.reason


def test_cli_budget_answer_marks_predicted(tmp_path: Path, capsys: pytest.CaptureFixture):
    sweep = tmp_path / "cli"
    planned_job(sweep, 0, stage=2, resolution=128, planned=plan(gpu=3000.0, floor=0.2))
    assert report_main([str(sweep), "--budget-mib", "4000"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 2 | none | 128 | 8 | planned | n/a | 3000 |" in out  # one job: its identifying keys
    assert "Budget 4000 MiB (gpu_peak_process_mib): Fastest that fits 4000 MiB of gpu_peak_process_mib by " \
           "predicted figures" in out
    assert "by predicted figures" in (sweep / "summary.md").read_text()

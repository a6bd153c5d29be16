"""Sweep reports with adapters: the adapter as a configuration column, trainable and frozen parameter counts
beside the configuration, and summaries written before adapters existed (no `adapter` choice, no counts).

Every summary.json below is a TEST FIXTURE, hand-written to exercise the aggregation: the numbers are
made up and are not measurements of anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_report import read_csv, write_job
from zerotune.report.budget import budget_answer
from zerotune.report.build import build_report
from zerotune.report.collect import collect_runs, swept_keys


def adapter_job(sweep: Path, num: int, *, adapter: str | None, counts: tuple[int, int] | None = None,
                num_params: int | None = None, step: float = 0.5, gpu: float = 6000.0) -> Path:
    """A job of a sweep over `adapter` (None: a summary from before adapters, without the choice)."""
    job = write_job(sweep, num, stage=2, resolution=128, gpu=gpu, step=step)
    group = "lora" if adapter and adapter != "none" else "none"
    with open(job / ".hydra" / "overrides.yaml", "a") as f:
        f.write(f"- adapter={group}\n")
    data = json.loads((job / "summary.json").read_text())
    if adapter is not None:
        data["choices"]["adapter"] = adapter
    if counts is not None:
        data["trainable_params"], data["frozen_params"] = counts
    if num_params is not None:
        data["num_params"] = num_params
    (job / "summary.json").write_text(json.dumps(data))
    return job


def test_the_adapter_is_a_configuration_column_with_the_parameter_counts(tmp_path: Path):
    sweep = tmp_path / "sweep"
    adapter_job(sweep, 0, adapter="none", counts=(2_654_593, 0), num_params=2_654_593, step=0.5)
    adapter_job(sweep, 1, adapter="lora-r16", counts=(271_360, 2_383_233), num_params=2_654_593, step=0.3)
    rows = collect_runs([sweep])
    assert swept_keys(rows) == ["adapter"]
    assert [(r["params"]["adapter"], r["trainable_params"], r["frozen_params"]) for r in rows] == [
        ("none", 2_654_593, 0), ("lora-r16", 271_360, 2_383_233)]

    out = tmp_path / "report"
    build_report([sweep], out=out)
    csv_rows = read_csv(out / "summary.csv")
    assert list(csv_rows[0])[:6] == ["sweep_dir", "job", "adapter", "trainable_params", "frozen_params", "status"]
    assert [(r["adapter"], r["trainable_params"], r["frozen_params"]) for r in csv_rows] == [
        ("lora-r16", "271360", "2383233"), ("none", "2654593", "0")]  # exact in the CSV, sorted by adapter
    md = (out / "summary.md").read_text()
    assert "| job | adapter | trainable params | frozen params | status |" in md
    assert "| 1 | lora-r16 | 271k | 2.38M | ok |" in md and "| 0 | none | 2.65M | 0 | ok |" in md


def test_summaries_from_before_adapters_trained_everything(tmp_path: Path):
    old, new = tmp_path / "old", tmp_path / "new"
    adapter_job(old, 0, adapter=None, num_params=2_654_593)  # no adapter choice, no counts: full training
    adapter_job(old, 1, adapter=None)  # nor num_params: the counts are unknown, never 0
    adapter_job(new, 0, adapter="lora-r4", counts=(67_840, 2_654_593))
    rows = collect_runs([old, new])
    assert [r["params"]["adapter"] for r in rows] == ["none", "none", "lora-r4"]
    assert [(r["trainable_params"], r["frozen_params"]) for r in rows] == [
        (2_654_593, 0), (None, None), (67_840, 2_654_593)]
    assert "adapter" in swept_keys(rows)
    build_report([old, new], out=tmp_path / "merged")
    md = (tmp_path / "merged" / "summary.md").read_text()
    assert "/old | 1 | none | n/a | n/a | ok |" in md and "/old | 0 | none | 2.65M | 0 | ok |" in md
    by_place = {(Path(r["sweep_dir"]).name, r["job"]): r for r in read_csv(tmp_path / "merged" / "summary.csv")}
    assert by_place[("old", "1")]["trainable_params"] == "" and by_place[("old", "0")]["frozen_params"] == "0"


def test_a_sweep_without_counts_keeps_its_columns(tmp_path: Path):
    sweep = tmp_path / "sweep"
    write_job(sweep, 0, stage=2, resolution=128, gpu=6000.0)
    write_job(sweep, 1, stage=3, resolution=128, gpu=5000.0)
    build_report([sweep], out=tmp_path / "report")
    header = list(read_csv(tmp_path / "report" / "summary.csv")[0])
    assert "trainable_params" not in header and "adapter" not in header
    assert collect_runs([sweep])[0]["params"]["adapter"] == "none"  # known, but it varies in nothing


def test_budget_says_adapter_and_full_steps_are_different_work(tmp_path: Path):
    sweep = tmp_path / "sweep"
    adapter_job(sweep, 0, adapter="none", counts=(2_654_593, 0), step=0.5)
    adapter_job(sweep, 1, adapter="lora-r16", counts=(271_360, 2_383_233), step=0.3)
    answer = budget_answer(collect_runs([sweep]), 24576)
    assert answer.best["job"] == "1" and "adapter=lora-r16 (job 1)" in answer.reason
    assert "differ in adapter" in answer.reason and "--where adapter=lora-r16" in answer.reason
    only_lora = budget_answer(collect_runs([sweep]), 24576, where={"adapter": "lora-r16"})
    assert only_lora.best["job"] == "1" and "differ in" not in only_lora.reason

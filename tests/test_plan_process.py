"""A CPU run's host prediction as the processes' RSS (plan/host_memory.py), and the report's host ratio, printed
only where the prediction describes the measurement.

The summaries built below are TEST FIXTURES: their numbers are made up, except where a test measures (the
import baseline, and the slow sweep at the end).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.test_report import read_csv, write_job
from tests.test_report_plan import plan, with_plan
from zerotune.plan import host_memory as process
from zerotune.report.build import build_report
from zerotune.report.collect import HOST_RATIO, collect_runs
from zerotune.report.table import value
from zerotune.rundir.plan import Plan, Term

# ---------------------------------------------------------------- the import baseline (measured)


def test_the_import_baseline_is_measured_cached_and_keyed(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    baseline = process.process_baseline_mib()
    assert baseline is not None and 100 < baseline < 4096  # torch alone is more than 100 MiB resident
    key = process.baseline_key()
    assert f"python{platform.python_version()}" in key and f"torch{torch.__version__}" in key
    stored = json.loads((tmp_path / "plan" / process.CACHE_FILE).read_text())
    assert stored[key]["rss_mib"] == baseline and stored[key]["hwm_mib"] >= baseline
    assert "zerotune.train.trainer" in stored[key]["modules"]
    with monkeypatch.context() as patched:  # another import list is another figure
        patched.setattr(process, "WORKER_IMPORTS", ("torch",))
        assert process.baseline_key() != key
    for build in ("2.13.0+cu130", "2.13.0+cpu"):  # another build of the same release is another figure
        with monkeypatch.context() as patched:
            patched.setattr(torch, "__version__", build)
            assert f"torch{build}|" in process.baseline_key()
    # Read back, not measured again: a planted figure under the key is what comes out.
    stored[key]["rss_mib"] = 123.0
    (tmp_path / "plan" / process.CACHE_FILE).write_text(json.dumps(stored))
    monkeypatch.setattr(process, "measure_imports", lambda modules, then="": pytest.fail("measured again"))
    assert process.process_baseline_mib() == 123.0


def test_the_child_runs_what_a_worker_does_after_its_imports():
    """`then`: a card's worker makes CUDA's context and loads cuBLAS before the model (CUDA_START); here, 200 MiB
    touched stands in for it, and the child's RSS shows it."""
    alone = process.measure_imports(("json",))
    grown = process.measure_imports(("json",), "x = bytearray(200 * 2**20)\nx[::4096] = b'1' * len(x[::4096])")
    assert alone is not None and grown is not None and grown["rss_mib"] - alone["rss_mib"] > 150


def test_a_card_plan_takes_the_baseline_on_the_card_and_says_so_where_none_is_here(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    ran: list[str] = []

    def measure(modules: tuple[str, ...], then: str = "") -> dict:
        ran.append(then)
        return {"rss_mib": 500.0 + (700.0 if then else 0.0), "hwm_mib": None, "modules": list(modules)}

    monkeypatch.setattr(process, "measure_imports", measure)
    monkeypatch.setattr(process, "_card_here", lambda: False)  # this machine: no card, nothing measured for one
    assert process.process_baseline_mib(on_card=True) is None and ran == []
    here = process.card_process_prediction(GPU_PLAN, 1).host_process_terms.terms[1]
    assert here.mib == 500.0 and "no card here" in here.note and "unmeasured" in here.note
    monkeypatch.setattr(process, "_card_here", lambda: True)  # a card's host: CUDA started in the child
    card = process.card_process_prediction(GPU_PLAN, 1).host_process_terms.terms[1]
    assert card.mib == 1200.0 and "on its card" in card.note and ran[-1] == process.CUDA_START


def test_an_import_that_fails_is_unmeasured(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path))
    assert process.measure_imports(("zerotune_no_such_module",)) is None
    monkeypatch.setattr(process, "WORKER_IMPORTS", ("zerotune_no_such_module",))
    assert process.process_baseline_mib() is None
    assert not (tmp_path / "plan" / process.CACHE_FILE).exists()


# ---------------------------------------------------------------- the node's prediction


def terms(*pairs: tuple[str, float]) -> list[Term]:
    return [Term(name, mib, "") for name, mib in pairs]


CPU_PLAN = Plan.made(device="cpu", step_peak_mib=300.0, host_peak_mib=9.0,
                     host_terms=terms(("optimizer_states", 20.0), ("model_load", 50.0)))
GPU_PLAN = Plan.made(device="cuda", step_peak_mib=999.0, host_peak_mib=9.0,
                     gpu_terms=terms(("cuda_context", 500.0), ("params", 40.0), ("activations", 60.0)),
                     host_terms=terms(("deepspeed:pinned", 10.0), ("model_load", 50.0)))


def test_node_prediction_is_parent_plus_ranks_times_baseline_and_tensors():
    node = process.node_rss_prediction(CPU_PLAN, 2, 450.0, 0.0)
    assert node.mib == 0.0 + 2 * (450.0 + 300.0)  # a CPU plan's step peak
    assert [t.term for t in node.terms] == ["parent_process", "process_baseline", "rank_tensors"]
    # A GPU plan's step peak leaves out the host terms and has CUDA's: host.py's rank terms on a CPU instead.
    assert process.node_rss_prediction(GPU_PLAN, 1, 450.0, 0.0).mib == 450.0 + 40.0 + 60.0 + 10.0
    # The fp32 build at load time, when larger than the step.
    small = CPU_PLAN.adding(step_peak_mib=30.0)
    assert process.node_rss_prediction(small, 1, 450.0, 0.0).mib == 450.0 + 50.0
    # Unknown parts make an unknown prediction, never a guess.
    assert process.node_rss_prediction(CPU_PLAN, 1, None, 0.0).mib is None
    assert process.node_rss_prediction(Plan(), 1, 450.0, 0.0).mib is None


def test_marking_makes_the_host_figure_a_process_rss_prediction():
    marked = process.mark_process_prediction(CPU_PLAN, process.node_rss_prediction(CPU_PLAN, 1, 450.0, 0.0))
    assert marked.host_peak_mib == 750.0 and marked.host_peak_kind == process.PROCESS_RSS
    assert marked.host_process_terms.terms[1].mib == 450.0
    assert CPU_PLAN.host_peak_mib == 9.0 and "host_process_terms" not in CPU_PLAN  # a new plan, the one given kept
    # summary.json holds the same record, and reads back as it was written.
    assert Plan.from_dict(marked.to_dict()) == marked
    assert marked.to_dict()["host_process_terms"] == {
        "mib": 750.0, "source": "process RSS: parent + ranks × (import baseline + tensors)",
        "terms": [t.to_dict() for t in marked.host_process_terms.terms]}
    unknown = process.mark_process_prediction(CPU_PLAN, process.node_rss_prediction(CPU_PLAN, 1, None, 0.0))
    assert unknown.host_peak_mib == 9.0 and "host_peak_kind" not in unknown
    assert unknown.host_process_terms.mib is None


# ---------------------------------------------------------------- the report's host ratio


def test_the_host_ratio_is_printed_for_a_process_rss_plan_only(tmp_path: Path):
    sweep = tmp_path / "multirun" / "2026-12-02" / "10-00-00-000001"
    with_plan(write_job(sweep, 0, stage=1, resolution=16, host=660.0), plan(host=9.0))
    with_plan(write_job(sweep, 1, stage=3, resolution=16, host=660.0),
              {**plan(host=600.0), "host_peak_kind": process.PROCESS_RSS})
    rows = {r["job"]: r for r in collect_runs([sweep])}
    assert value(rows["0"], HOST_RATIO) is None  # 660 / 9 would be 73: never printed
    assert value(rows["1"], HOST_RATIO) == 1.1
    build_report([sweep])
    cells = {r["job"]: r for r in read_csv(sweep / "summary.csv")}
    assert cells["0"][HOST_RATIO] == "" and float(cells["0"]["plan_host_peak_mib"]) == 9.0
    assert float(cells["1"][HOST_RATIO]) == 1.1
    md = (sweep / "summary.md").read_text()
    assert "| 0 | 1 | ok | n/a | 5000 | n/a | n/a | n/a | 660 | 9 | - |" in md
    assert "| 1 | 3 | ok | n/a | 5000 | n/a | n/a | n/a | 660 | 600 | 1.10 |" in md
    assert "\"-\" where it is a GPU plan's host terms" in md


# ---------------------------------------------------------------- the CPU sweep (slow)


@pytest.mark.slow
def test_the_cpu_sweep_reports_true_host_ratios(tmp_path: Path):
    """experiment=stage_resolution_batch_cpu (8 jobs, about 4 minutes on 2 cores): each job's host figure is
    the process-RSS prediction, within 0.8-1.25 of the measured peak."""
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "experiment=stage_resolution_batch_cpu", f"hydra.sweep.dir={sweep}", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = collect_runs([sweep])
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    for row in rows:
        assert row["plan_host_peak_kind"] == process.PROCESS_RSS, row["job"]
        assert 0.8 <= value(row, HOST_RATIO) <= 1.25, (row["job"], row["host_peak_rss_mib"], row["plan_host_peak_mib"])

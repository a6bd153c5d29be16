"""The GPU kit's `loading` part (`bash benchmarks/gpu/run.sh loading`): does zerotune's loading peak now beat
SimpleTuner's figures? The reference rows at deepspeed.param_groups=16 then =1, ZeRO-3 with the parameters on the
host, then (as the budget allows) the 8 GiB claim, expandable segments and smaller reduce buckets, each row written
as it ends. Its plan holds what fits 480 s on a bare card, and marks the rest past the budget with the later call
that runs it. The whole dry run (every row, tiny shapes on this CPU, 75 to 140 s on 2 shared cores) runs under
-m slow."""

from __future__ import annotations

import json
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

pytestmark = pytest.mark.timeout(600)

REF_128, REF_1024, REF_8GIB = "experiment=sdxl_4090_128_bs8", "experiment=sdxl_4090_1024_bs8", \
    "experiment=sdxl_1024_bs1_8gib"
TEN, K1, K16 = "train.max_steps=10", "deepspeed.param_groups=1", "deepspeed.param_groups=16"
# the brief's order: 1. the two reference rows at K=16 (the part's question), then at K=1 (the control); 2. ZeRO-3
# with parameters and optimizer on the host; 3. the 8 GiB claim at K=16, expandable segments, smaller buckets
LOADING = {
    "ref_128_bs8_k16": [REF_128, TEN, K16],
    "ref_1024_bs8_k16": [REF_1024, TEN, K16],
    "ref_128_bs8_k1": [REF_128, TEN, K1],
    "ref_1024_bs8_k1": [REF_1024, TEN, K1],
    "z3_params_cpu_1024_bs8": [REF_1024, TEN, "zero_stage=3", "offload=cpu", "offload.params=true",
                               "deepspeed.reduce_bucket_size=100000000"],
    "ref_1024_bs1_k16": [REF_8GIB, TEN, K16],
    "ref_128_bs8_k16_expandable": [REF_128, TEN, K16],
    "ref_128_bs8_k16_bucket1e8": [REF_128, TEN, K16, "deepspeed.reduce_bucket_size=100000000"],
    "ref_128_bs8_k16_bucket2e8": [REF_128, TEN, K16, "deepspeed.reduce_bucket_size=200000000"],
}
GPU_FIGURES = ("gpu_peak_process_mib", "gpu_peak_device_mib", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib",
               "step_time_median_s")


def test_loading_rows_are_in_order_with_their_overrides():
    assert [r.name for r in parts.LOADING] == list(LOADING)
    for row in parts.LOADING:
        assert row.overrides == LOADING[row.name] and row.kind == "train", row
    env = {r.name: r.env for r in parts.LOADING if r.env}
    assert env == {"ref_128_bs8_k16_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    against = {r.name: r.against for r in parts.LOADING if r.against}
    assert against == {"ref_128_bs8_k16": "ref_128_bs8_k1", "ref_1024_bs8_k16": "ref_1024_bs8_k1",
                       "z3_params_cpu_1024_bs8": "ref_1024_bs8_k16", "ref_128_bs8_k16_expandable": "ref_128_bs8_k16",
                       "ref_128_bs8_k16_bucket1e8": "ref_128_bs8_k16", "ref_128_bs8_k16_bucket2e8": "ref_128_bs8_k16"}


def test_each_loading_row_composes_as_the_card_runs_it():
    seen = {}
    for row in parts.LOADING:
        cfg, error = kit.compose_row(row)
        assert error is None, (row.name, error)
        seen[row.name] = cfg
        assert cfg.model.name == "sdxl" and cfg.data.name == "synthetic" and cfg.train.max_steps == 10, row.name
        assert cfg.offload.device == "cpu" and cfg.train.gradient_checkpointing is True
        assert cfg.plan.guard == "warn" and cfg.checkpoint.final is False  # rows.COMMON
    for name in ("ref_128_bs8_k16", "ref_1024_bs8_k16", "ref_1024_bs1_k16", "ref_128_bs8_k16_expandable",
                 "ref_128_bs8_k16_bucket1e8", "ref_128_bs8_k16_bucket2e8"):
        assert seen[name].deepspeed.param_groups == 16 and seen[name].zero_stage.stage == 2, name
    for name in ("ref_128_bs8_k1", "ref_1024_bs8_k1"):
        assert seen[name].deepspeed.param_groups == 1 and seen[name].zero_stage.stage == 2, name
    z3 = seen["z3_params_cpu_1024_bs8"]
    assert z3.zero_stage.stage == 3 and z3.offload.params is True and z3.deepspeed.param_groups == "auto"
    assert z3.deepspeed.reduce_bucket_size == 100_000_000  # the planner's cheapest: 8,678 MiB on an rtx4090
    assert (z3.resolution.size, z3.train.batch_size) == (1024, 8)
    for name, size, batch, mib in (("ref_128_bs8_k16", 128, 8, 9237), ("ref_1024_bs8_k16", 1024, 8, 13102),
                                   ("ref_1024_bs1_k16", 1024, 1, 8192)):
        cfg = seen[name]
        assert (cfg.resolution.size, cfg.train.batch_size, cfg.reference.gpu_peak_process_mib) == (size, batch, mib)
    assert seen["ref_128_bs8_k16"].deepspeed.reduce_bucket_size == "auto"  # the default the bucket rows beat or not
    assert seen["ref_128_bs8_k16_bucket1e8"].deepspeed.reduce_bucket_size == 100_000_000
    assert seen["ref_128_bs8_k16_bucket2e8"].deepspeed.reduce_bucket_size == 200_000_000


def card_plan(tmp_path: Path, cpu_adam_built: bool) -> dict:
    """The loading part's plan for the card, as it prints before it starts: nothing run."""
    part = kit.Part("loading", tmp_path, True, report.loading_markdown, time.time())
    cpu_adam = kit.CpuAdam(dry_run=True)  # plans the CPU-Adam build, as on a bare machine
    cpu_adam.pending = not cpu_adam_built
    pieces = kit.row_pieces(part, parts.LOADING, tmp_path, False, cpu_adam, None)
    install = {"piece": "install", "estimate_s": 1.7, "basis": "the H200's", "command": "run.sh", "status": "done",
               "wall_s": 1.7}  # measured on the H200's bare machine (experiments/results/gpu/h200-2026-11-27)
    return kit.plan(part, pieces, install, within_budget=True)


def test_the_loading_plan_for_a_bare_card_fits_480_s_k16_first(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROTUNE_GPU_KIT_BUDGET_S", raising=False)
    monkeypatch.delenv("ZEROTUNE_GPU_KIT_ROWS", raising=False)
    record = card_plan(tmp_path, cpu_adam_built=False)
    assert kit.BUDGET_S == 480 and record["budget_s"] == 480
    entries = {e["piece"]: e for e in record["plan"][1:]}
    assert list(entries) == list(LOADING)
    # each row at its record's seconds for 10 steps; the first row with offload builds CPU-Adam on a bare machine
    ten = {"ref_128_bs8_k16": estimates.REF_128_BS8.seconds(10) + estimates.CPU_ADAM_BUILD_S,
           "ref_1024_bs8_k16": estimates.REF_1024_BS8.seconds(10), "ref_128_bs8_k1": estimates.REF_128_BS8.seconds(10),
           "ref_1024_bs8_k1": estimates.REF_1024_BS8.seconds(10),
           "z3_params_cpu_1024_bs8": estimates.Z3_PARAMS_1024_BS8.seconds(10),
           "ref_1024_bs1_k16": estimates.REF_1024_BS1.seconds(10)}
    for name, seconds in ten.items():
        assert entries[name]["estimate_s"] == pytest.approx(seconds, abs=0.05), name
    assert "CPU-Adam build 92.2 s" in entries["ref_128_bs8_k16"]["basis"]
    assert "allowance, unmeasured" in entries["z3_params_cpu_1024_bs8"]["basis"]
    assert "deepspeed.param_groups=16" in entries["ref_128_bs8_k16"]["command"]
    assert entries["ref_128_bs8_k16_expandable"]["command"].startswith(
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -m zerotune train ")
    # the plan: the two K=16 rows within the 480 s; the rest past it, named in the later call
    within = [n for n, e in entries.items() if e["status"] == "planned"]
    assert within == ["ref_128_bs8_k16", "ref_1024_bs8_k16"]
    assert record["plan_total_s"] <= 480
    assert record["plan_total_s"] == pytest.approx(1.7 + sum(entries[n]["estimate_s"] for n in within), abs=0.1)
    past = [n for n, e in entries.items() if e["status"] == kit.PAST]
    assert past == list(LOADING)[2:]
    assert record["past_budget_s"] == pytest.approx(sum(entries[n]["estimate_s"] for n in past), abs=0.1)
    assert record["later_call"] == f"ZEROTUNE_GPU_KIT_ROWS={','.join(past)} bash benchmarks/gpu/run.sh loading"
    text = report.plan_text(record)
    assert "budget 480 s from the command's start" in text and "of 480 s: fits" in text
    assert "[past the budget]" in text and record["later_call"] in text


def test_with_cpu_adam_built_the_k1_control_fits_too(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROTUNE_GPU_KIT_BUDGET_S", raising=False)
    monkeypatch.delenv("ZEROTUNE_GPU_KIT_ROWS", raising=False)
    record = card_plan(tmp_path, cpu_adam_built=True)
    within = [e["piece"] for e in record["plan"][1:] if e["status"] == "planned"]
    assert within == ["ref_128_bs8_k16", "ref_1024_bs8_k16", "ref_128_bs8_k1"] and record["plan_total_s"] <= 480


def test_a_piece_past_the_budget_still_runs_when_it_fits_what_is_left(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_GPU_KIT_BUDGET_S", "100")
    part = kit.Part("loading", tmp_path, True, report.loading_markdown, time.time())
    ran, left_out = [], {}

    def piece(name: str, seconds: float) -> kit.Piece:
        return kit.Piece(name, seconds, "test", f"run {name}", run=lambda limit: ran.append(name) or "ok",
                         not_run=lambda why: left_out.update({name: why}))

    # a (50) fits; b (60) is past 100 after a; c (40) fits after a; d (500) never fits
    record = kit.run_plan(part, [piece("a", 50), piece("b", 60), piece("c", 40), piece("d", 500)],
                          kit.install_entry(part, True, True), within_budget=True)
    on_disk = json.loads((tmp_path / "loading.json").read_text())
    assert on_disk["plan_total_s"] == pytest.approx(90, abs=1) and on_disk["past_budget_s"] == 560
    assert ran == ["a", "b", "c"]  # each ended at once: b fit what was left at its turn
    assert list(left_out) == ["d"] and left_out["d"].startswith("not run: needs about 500 s")
    assert record["later_call"] == on_disk["later_call"] == "ZEROTUNE_GPU_KIT_ROWS=d bash benchmarks/gpu/run.sh loading"


def test_run_sh_lists_the_loading_part():
    usage = subprocess.run(["bash", "benchmarks/gpu/run.sh"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode != 0 and "first|loading|env|reference|grid|paths|flux|all" in usage.stderr
    # the part is accepted: the option after it is what is refused, before anything is installed or run
    wrong = subprocess.run(["bash", "benchmarks/gpu/run.sh", "loading", "--dry"], cwd=ROOT, capture_output=True,
                           text=True)
    assert wrong.returncode == 2 and "unknown option '--dry'" in wrong.stderr
    assert "PART: first | loading | env" in (ROOT / "benchmarks/gpu/run.sh").read_text()


@pytest.mark.slow  # every row on sdxl_tiny, 75 to 140 s on 2 cores
def test_the_dry_run_runs_every_row_and_writes_the_tables(tmp_path):
    env = {**cli_env(), "OUT": str(tmp_path / "out"), "GPU_KIT_WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable, "HF_HOME": str(tmp_path / "hf_home"), search.CONFIG_DIR_ENV: ""}
    for name in [n for n in env if n.startswith(("ACCELERATE_", "ZEROTUNE_GPU_KIT_"))]:
        del env[name]
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "loading", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["loading.json", "loading.md"]
    record, md = json.loads((out / "loading.json").read_text()), (out / "loading.md").read_text()
    assert record["part"] == "loading" and record["dry_run"] is True and record["complete"] is True
    assert record["budget_s"] == 480 and record["plan_total_s"] <= 480
    printed = proc.stdout
    assert printed.index("gpu kit: loading: plan") < printed.index("gpu kit: loading/ref_128_bs8_k16 (")
    assert [r["name"] for r in record["rows"]] == list(LOADING)
    by_name = {r["name"]: r for r in record["rows"]}
    for name, row in by_name.items():  # the dry run's rows are quick: each fits what is left at its turn
        assert row["status"] == "ok" and row["exit_code"] == 0 and row["measured"]["steps"] == 1, row
        assert all(row["measured"][k] is None for k in GPU_FIGURES) and row["ratio"] is None
        assert row["measured"]["host_peak_rss_mib"] > 0 and row["predicted"]["run_peak_mib"] > 0
        assert [p["phase"] for p in row["phases_torch"]] == ["loading", "step"]
        assert [o for o in LOADING[name] if not o.startswith(("train.max_steps=", "offload"))] == \
            [o for o in row["overrides"] if o in LOADING[name]]
    assert {n: r["param_groups"] for n, r in by_name.items()} == {
        n: 16 if "k16" in n else 1 for n in LOADING}  # as the runs resolved it (ZeRO-3: auto is 1)
    assert by_name["ref_128_bs8_k16"]["reference"]["gpu_peak_process_mib"] == 9237
    assert by_name["ref_128_bs8_k16_expandable"]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "| ref_128_bs8_k16 | ok | 16 | 9,237 | unmeasured | unmeasured | " in md
    assert "| ref_1024_bs8_k1 | ok | 1 | 13,102 | unmeasured | " in md and "| ref_1024_bs1_k16 | ok | 16 | 8,192 |" in md
    assert "| ref_128_bs8_k16_bucket1e8 | ref_128_bs8_k16 | " in md and "| z3_params_cpu_1024_bs8 | loading | " in md

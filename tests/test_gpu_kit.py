"""The GPU kit's dry run: `bash benchmarks/gpu/run.sh all --dry-run` walks every part's steps on this CPU with
tiny shapes, so the kit cannot rot before a card arrives. Its files are read back: every row present, the rows run
really ran, and no GPU figure is invented (null in the JSON, "unmeasured" in the tables).

The whole dry run takes about 50 s on 2 cores: it runs under `-m slow`. The fast suite runs the kit's first call
(`first --dry-run`, tests/test_gpu_kit_first.py), the part a lent card runs every session, whose env and
reference steps are the same code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import ROOT, cli_env
from zerotune.config import search

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import parts  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

GPU_FIGURES = ("gpu_peak_process_mib", "gpu_peak_device_mib", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib",
               "step_time_median_s")
PHASES = ["after_caching", "after_validation_decode", "after_release", "end"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_kit")
    out, work = tmp / "out", tmp / "work"
    # as the suite's autouse fixtures do for each test: no accelerate config or user config folder leaks in
    env = {**cli_env(), "OUT": str(out), "GPU_KIT_WORK": str(work), "PYTHON": sys.executable,
           "HF_HOME": str(tmp / "hf_home"), search.CONFIG_DIR_ENV: ""}
    for name in [n for n in env if n.startswith("ACCELERATE_")]:
        del env[name]
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "all", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def load(out: Path, part: str) -> dict:
    record = json.loads((out / f"{part}.json").read_text())
    assert record["part"] == part and record["dry_run"] is True and record["complete"] is True
    return record


def test_every_part_writes_its_json_and_markdown_and_nothing_else(dry_run):
    # the device tool brings back at most 8 files from $OUT
    assert sorted(p.name for p in dry_run.iterdir()) == sorted(f"{p}.{ext}" for p in ("env", "reference", "grid",
                                                                                      "paths") for ext in ("json", "md"))


def test_env_records_versions_and_each_first_use_without_gpu_figures(dry_run):
    probe = load(dry_run, "env")["probe"]
    assert probe["gpu_present"] is False
    assert probe["versions"]["torch"] == torch.__version__ and probe["versions"]["gpu"] is None
    assert [u["step"] for u in probe["first_uses"]] == ["before_cuda", "after_zeros", "after_bf16_matmul",
                                                        "after_conv", "after_nccl_init"]
    for use in probe["first_uses"]:
        assert use["smi_device_used_mib"] is None and use["torch_reserved_mib"] is None, use
    adam = probe["cpu_adam"]
    assert adam["op"] == "cpu_adam" and adam["error"] is None
    assert (adam["seconds"] is not None) == adam["was_cached"]  # loaded when cached, never built in a dry run
    md = (dry_run / "env.md").read_text()
    assert "| after_nccl_init | unmeasured | unmeasured |" in md and "| torch | " + torch.__version__ in md


def test_reference_runs_one_row_of_each_kind_and_lists_the_rest(dry_run):
    rows = {r["name"]: r for r in load(dry_run, "reference")["rows"]}
    assert list(rows) == [r.name for r in parts.REFERENCE]
    ran = rows["ref_128_bs8"]
    assert ran["status"] == "ok" and ran["exit_code"] == 0 and ran["measured"]["steps"] == 1
    assert "experiment=sdxl_4090_128_bs8" in ran["overrides"] and "model=sdxl_tiny" in ran["overrides"]
    assert ran["reference"]["gpu_peak_process_mib"] == 9237
    assert ran["predicted"]["gpu_peak_mib"] > 0 and {t["term"] for t in ran["predicted"]["gpu_terms"]} >= {
        "params", "activations"}
    assert ran["measured"]["host_peak_rss_mib"] > 0
    phased = rows["phases_128_bs8_kept"]
    assert phased["status"] == "ok" and phased["phases_measured"]["keep_reserved"] is True
    assert [m["phase"] for m in phased["phases_measured"]["marks"]] == PHASES
    assert all(m["nvml_device_used_mib"] is None for m in phased["phases_measured"]["marks"])
    assert phased["predicted"]["gpu_peak_mib"] > 0
    for row in rows.values():
        assert all(row["measured"][k] is None for k in GPU_FIGURES), row
        assert row["ratio"] is None
    for name in ("ref_1024_bs8", "ref_1024_bs1_8gib", "phases_128_bs8_empty_cache"):
        assert rows[name]["status"].startswith("not run: a dry run"), rows[name]
    assert "experiment=sdxl_1024_bs1_8gib" in rows["ref_1024_bs1_8gib"]["command"]
    md = (dry_run / "reference.md").read_text()
    assert "| ref_128_bs8 | ok | " in md and "| phases_128_bs8_kept | after_release | unmeasured |" in md


def test_grid_composes_every_row(dry_run):
    rows = load(dry_run, "grid")["rows"]
    assert [r["name"] for r in rows] == [r.name for r in parts.GRID] and len(rows) == 14
    names = {r["name"] for r in rows}
    assert {f"z{s}_{o}_512_bs{b}" for s in (1, 2, 3) for o in ("none", "cpu") for b in (1, 4)} < names
    assert {"lora_1024_bs1", "z2_cpu_512_bs1_no_ckpt"} < names
    for row in rows:  # the reference part ran this kind already: listed with its command, not a config error
        assert row["status"] == "not run: a dry run runs one row of each kind", row
        assert all(row["measured"][k] is None for k in GPU_FIGURES)
    lora = next(r for r in rows if r["name"] == "lora_1024_bs1")
    assert "adapter=lora" in lora["command"] and "plan.guard=warn" in lora["command"]


def test_paths_selects_the_cuda_tests_and_skips_them_here(dry_run):
    record = load(dry_run, "paths")
    assert record["exit_code"] == 0
    outcomes = {r["name"]: r["outcome"] for r in record["rows"]}
    assert "test_nvml_telemetry_reads_the_process_on_the_card" in outcomes
    assert "test_checkpoint_resume_and_export_on_the_card" in outcomes and len(outcomes) == 6
    assert set(outcomes.values()) == {"skipped"}


@pytest.mark.slow
def test_the_flux_part_trains_a_tiny_twin_of_its_first_row(tmp_path):
    """`run.sh flux --dry-run`: FLUX.1's LoRA row as flux_tiny on this CPU (one row of each kind), the others listed
    with their estimates; every GPU figure null."""
    out = tmp_path / "out"
    env = {**cli_env(), "OUT": str(out), "GPU_KIT_WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
           "HF_HOME": str(tmp_path / "hf_home"), search.CONFIG_DIR_ENV: ""}
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "flux", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in load(out, "flux")["rows"]}
    assert list(rows) == ["flux_lora_z3_cpu_1024_bs1", "sd35_medium_z3_cpu_1024_bs1", "flux_full_z3_cpu_1024_bs1"]
    lora = rows["flux_lora_z3_cpu_1024_bs1"]
    assert lora["status"] == "ok" and "model=flux_tiny" in lora["command"] and "adapter=lora" in lora["command"]
    assert lora["measured"]["gpu_peak_process_mib"] is None  # no card: unmeasured, not 0

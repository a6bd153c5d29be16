"""One measured row: a zerotune training run (its own command line, as a user types it), read back from the
run's summary.json into measured figures beside the planner's prediction for the same job.

A figure that was not measured is None (JSON null; "unmeasured" in the Markdown), never 0 or a guess.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from estimates import Cost

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ("gpu_peak_process_mib", "gpu_peak_device_mib", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib",
            "host_peak_rss_mib")
# Every run the kit starts: nothing refused by the planner's guard, no SDXL checkpoint (over 30 GB) at the end.
COMMON = ["plan.guard=warn", "checkpoint.final=false"]
# --dry-run: the same rows on this CPU, shapes shrunk (sdxl_tiny, 32 px, batch 2, 1 step), and optimizer states
# kept on the device: offload=cpu's CPU-Adam op is a JIT build of minutes on 2 cores (the env part times it on
# the card).
# plan.gpu=h100: the job's prediction is a card's, as on the GPU machine (a CPU run's own plan is --device cpu's).
TINY = ["resolution=32", "train.batch_size=2", "train.max_steps=1", "offload=none", "plan.gpu=h100"]
# each row's model in miniature: the same class (the experiments' rows are SDXL's)
TINY_TWIN = {"sdxl": "sdxl_tiny", "flux": "flux_tiny", "sd35_large": "sd3_tiny", "sd35_medium": "sd3_tiny"}


# The last seconds of a row's time: zerotune stops its job at train.timeout_s and writes summary.json (what it
# measured) before the kit's own limit kills the process.
STOP_GRACE_S = 30


@dataclass
class Row:
    name: str
    overrides: list[str]
    cost: Cost                     # its seconds on an H100 (estimates.py): what the budget plans with
    note: str = ""
    kind: str = "train"            # train: `python -m zerotune train`; phases: benchmarks/gpu/phases.py
    phases: dict = field(default_factory=dict)   # phases.py's options (kind == "phases")
    env: dict = field(default_factory=dict)      # set in the job's environment, before anything starts CUDA
    against: str = ""              # the row it is compared with in the part's tables (same workload, one change)


def shrink(overrides: list[str], dry_run: bool) -> list[str]:
    """The row's overrides, or in a dry run the same with the tiny shapes last (they win)."""
    if not dry_run:
        return list(overrides)
    # offload's fields go with it (offload.params=true needs a host to put them on)
    keep = [o for o in overrides if not o.startswith(("train.batch_size=", "train.max_steps=", "resolution=", "offload=",
                                                      "offload."))]
    model = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model=")), "sdxl")
    return [*keep, f"model={TINY_TWIN[model]}", *TINY]


def command(row: Row, run_dir: Path, dry_run: bool, timeout_s: float) -> list[str]:
    # COMMON first: a row may set its own guard (the flux part's skipped row)
    overrides = [*COMMON, *shrink(row.overrides, dry_run), f"hydra.run.dir={run_dir}",
                 f"train.timeout_s={max(int(timeout_s) - STOP_GRACE_S, 30)}"]
    if row.kind == "phases":
        shapes = {"image_size": 32, "images": 4} if dry_run else {}  # TINY's resolution, two batches of 2
        opts = [f"--{k.replace('_', '-')}={v}" for k, v in {**row.phases, **shapes}.items()]
        dry = ["--dry-run"] if dry_run else []
        return [sys.executable, str(ROOT / "benchmarks/gpu/phases.py"), *dry, *opts, "--", *overrides]
    return [sys.executable, "-m", "zerotune", "train", *overrides]


def shown(row: Row, cmd: list[str]) -> str:
    """The command as the records show it: the row's environment first, then the command less the interpreter."""
    return " ".join([*(f"{k}={v}" for k, v in row.env.items()), *cmd[1:]])


def run_row(row: Row, work: Path, dry_run: bool, timeout_s: float) -> dict:
    """Runs the row's job (killed at `timeout_s`), and returns its record."""
    run_dir = work / row.name
    cmd = command(row, run_dir, dry_run, timeout_s)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **row.env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    start = time.monotonic()
    exit_code, log = run_bounded(cmd, work, env, timeout_s)
    record = {"name": row.name, "kind": row.kind, "note": row.note, "overrides": cmd[cmd.index("--") + 1:]
              if "--" in cmd else cmd[4:], "command": shown(row, cmd), "exit_code": exit_code,
              "wall_s": round(time.monotonic() - start, 1)}
    if row.env:
        record["env"] = dict(row.env)
    if row.against:
        record["against"] = row.against
    record.update(read_run(run_dir))
    if record["status"] != "ok":
        record["log_tail"] = log[-3000:]
    return record


def run_bounded(cmd: list[str], cwd: Path, env: dict | None, timeout_s: float) -> tuple[int | None, str]:
    """(exit code, output) of `cmd`; at `timeout_s` it and every process it started are killed, exit code None.
    A job's workers hold its output pipe: killing the job's parent alone would leave the kit waiting on them."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        return None, f"killed after {timeout_s:.0f} s\n{output}"


def kill_tree(pid: int) -> None:
    """The process and all its descendants, listed while it still holds them, then killed."""
    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def read_run(run_dir: Path) -> dict:
    """Measured figures and the planner's prediction, from the run's summary.json (and phases.py's own file)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return {"status": "no summary.json", "measured": unmeasured(), "predicted": None}
    summary = json.loads(path.read_text())
    memory, perf = summary.get("memory") or {}, summary.get("perf") or {}
    measured = {k: memory.get(k) for k in MEASURED}
    measured["step_time_median_s"] = perf.get("step_time_median_s")
    measured["steps"] = summary.get("steps")
    extra = run_dir / "phases.json"
    phases = json.loads(extra.read_text()) if extra.is_file() else {}
    plan = summary.get("plan") or phases.pop("plan", None)  # phases.py plans in its own process
    out = {"status": summary.get("status"), "measured": measured, "predicted": prediction(plan),
           "reference": (summary.get("experiment") or {}).get("reference"),
           # per phase, per step, per op build: what the next lease's estimates (estimates.py) are made of
           "phases_torch": [phase_peaks(p) for p in memory.get("phases") or []],
           "step_times_s": step_times(run_dir / "metrics.jsonl"), "ops_build": summary.get("ops_build"),
           "startup": summary.get("startup")}
    if phases:
        out["phases_measured"] = phases
    out["param_groups"] = param_groups(run_dir / "resolved.json")
    if phases:  # its own NVML sampler: the card's whole use (the job is the only process on it)
        measured["phases_device_peak_mib"] = phases.get("nvml_device_peak_mib")
    peak = measured.get("gpu_peak_process_mib") or measured.get("phases_device_peak_mib")
    predicted = out["predicted"] or {}  # nvidia-smi's peak is the run's: its phases where the plan has them
    out["ratio"] = ratio(peak, predicted.get("run_peak_mib") or predicted.get("gpu_peak_mib"))
    return out


def param_groups(resolved: Path) -> int | None:
    """How many optimizer groups the run's engine was given (deepspeed.param_groups as resolved), where it says."""
    if not resolved.is_file():
        return None
    groups = json.loads(resolved.read_text()).get("param_groups")
    return groups.get("count") if isinstance(groups, dict) else None


def phase_peaks(phase: dict) -> dict:
    """One of the run's phases (loading, caching, step, sampling): its seconds and torch's peaks in it."""
    return {"phase": phase.get("phase"), "seconds": round(phase["end"] - phase["start"], 1),
            "gpu_max_allocated_mib": phase.get("gpu_max_allocated_mib"),
            "gpu_max_reserved_mib": phase.get("gpu_max_reserved_mib"),
            "host_peak_rss_mib": phase.get("host_peak_rss_mib")}


def step_times(metrics: Path) -> list[float]:
    """Each step's seconds, in order (the median leaves out zerotune's warm-up steps; these do not)."""
    if not metrics.is_file():
        return []
    rows = (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
    return [r["perf/step_time_s"] for r in rows if r.get("perf/step_time_s") is not None]


def unmeasured() -> dict:
    return {**dict.fromkeys(MEASURED), "step_time_median_s": None, "steps": None}


def prediction(plan: dict | None) -> dict | None:
    """The planner's answer for the job: its GPU peak, its terms, and its phases where the planner gives them."""
    if not plan:
        return None
    keep = ("gpu", "gpu_peak_mib", "step_peak_moment", "run_peak_mib", "run_peak_phase", "gpu_terms", "fits",
            "host_peak_mib", "time_floor_s", "workload")
    out = {k: plan.get(k) for k in keep}
    if "phases" in plan:  # the planner's per-phase prediction, once it has one: read, never required
        out["phases"] = plan["phases"]
    return out


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """predicted / measured, as the planner's reference rows give it (None when either is missing)."""
    if not measured or not predicted:
        return None
    return round(predicted / measured, 3)


def skipped(row: Row, why: str, dry_run: bool, reference: dict | None = None) -> dict:
    """A row not run (the part's time budget is spent, or a dry run runs one row of each kind). `reference`: the
    composed experiment's reference figures, where the row has them."""
    cmd = command(row, Path("<work>") / row.name, dry_run, 0)
    record = {"name": row.name, "kind": row.kind, "note": row.note, "command": shown(row, cmd), "status": why,
              "measured": unmeasured(), "predicted": None, "ratio": None}
    if reference is not None:
        record["reference"] = reference
    if row.env:
        record["env"] = dict(row.env)
    if row.against:
        record["against"] = row.against
    return record

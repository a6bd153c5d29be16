"""The recorded GPU rows, predicted again by today's planner: what a change to the planner does to its misses.

Reads every `*.json` the kit wrote under experiments/results/gpu/ (each row's overrides and its measured
nvidia-smi peak) and runs the planner on each row's own command line for the card it ran on. Runs on the CPU.

    python benchmarks/gpu/replan.py          # a Markdown table: recorded prediction, today's, measured, ratios
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results" / "gpu"


def recorded_rows() -> list[tuple[str, str, dict]]:
    """(card, folder, row) for each row that ran, the card from its folder's name (h100-2026-11-26)."""
    rows = []
    for path in sorted(RESULTS.glob("*/*.json")):
        record = json.loads(path.read_text())
        for row in record.get("rows", []):
            if row.get("status") == "ok" and row.get("kind", "train") == "train":
                rows.append((path.parent.name.split("-")[0], path.parent.name, row))
    return rows


def as_run_before_the_build_emptied_the_cache(answer: dict, groups: int) -> float:
    """The run's peak for a row recorded before zerotune emptied the CUDA cache after the engine's build (every row
    without a recorded `param_groups`): what ZeRO-1/2's loading freed (the parameters' own blocks and the
    partition's clone, the phase's `freed_at_end_mib`) stayed reserved under the step. The caching allocator
    places a tensor in a freed block only where it fits. Without offload, the step's peak tensors (the fp32
    gradient partition and Adam's two moments: each one tensor the size of a group's fp32 master partition) are
    larger than the largest freed block (the clone, in the run's dtype), so the two pools add. With offload those
    live on the host, the card's step tensors fit into the freed blocks, and the pool is the larger of the two."""
    phases = {p["phase"]: p for p in answer.get("phases", [])}
    loading, step = phases.get("loading"), phases.get("step")
    freed = (loading or {}).get("freed_at_end_mib")
    if not freed or step is None:
        return answer["run_peak_mib"]
    clone = next((t["mib"] for t in loading["terms"] if t["term"] == "master_partition_clone"), 0.0)
    master = sum(t["mib"] for t in answer["gpu_terms"] if t["term"] == "master_weights")
    under_step = step["peak_mib"] + freed if master / groups > clone else max(step["peak_mib"], loading["peak_mib"])
    return max(answer["run_peak_mib"], under_step)


def main() -> int:
    from zerotune.plan import gpus
    from zerotune.plan.command_line import plan_one

    print("| folder | row | card | recorded prediction MiB | today's MiB | nvidia-smi peak MiB | recorded / measured | today / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for card, folder, row in recorded_rows():
        # the job's own overrides, less where the kit put its run and its time limit
        overrides = [o for o in row["overrides"] if not re.match(r"(hydra\.run\.dir|train\.timeout_s)=", o)]
        groups = row.get("param_groups") or 1  # the groups the run's engine was given: 1 before the setting
        if not any(o.startswith("deepspeed.param_groups=") for o in overrides):
            overrides.append(f"deepspeed.param_groups={groups}")
        answer = plan_one(overrides, gpus.lookup(card))
        today = answer["run_peak_mib"] if "param_groups" in row else \
            as_run_before_the_build_emptied_the_cache(answer, groups)
        measured = row["measured"]["gpu_peak_process_mib"]
        before = (row.get("predicted") or {}).get("run_peak_mib")
        recorded, recorded_ratio = (f"{before:,.0f}", f"{before / measured:.3f}") if before else ("unrecorded", "-")
        print(f"| {folder} | {row['name']} | {card} | {recorded} | {today:,.0f} | {measured:,.0f} | "
              f"{recorded_ratio} | {today / measured:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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


def main() -> int:
    from zerotune.plan import gpus
    from zerotune.plan.command_line import plan_one

    print("| folder | row | card | recorded prediction MiB | today's MiB | nvidia-smi peak MiB | recorded / measured | today / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for card, folder, row in recorded_rows():
        # the job's own overrides, less where the kit put its run and its time limit
        overrides = [o for o in row["overrides"] if not re.match(r"(hydra\.run\.dir|train\.timeout_s)=", o)]
        if not any(o.startswith("deepspeed.param_groups=") for o in overrides):
            # the groups the run's engine was given; a row recorded before the setting had one
            overrides.append(f"deepspeed.param_groups={row.get('param_groups') or 1}")
        today = plan_one(overrides, gpus.lookup(card))["run_peak_mib"]
        measured = row["measured"]["gpu_peak_process_mib"]
        before = (row.get("predicted") or {}).get("run_peak_mib")
        recorded, recorded_ratio = (f"{before:,.0f}", f"{before / measured:.3f}") if before else ("unrecorded", "-")
        print(f"| {folder} | {row['name']} | {card} | {recorded} | {today:,.0f} | {measured:,.0f} | "
              f"{recorded_ratio} | {today / measured:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

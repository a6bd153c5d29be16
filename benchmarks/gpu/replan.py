"""The recorded GPU rows, predicted again by today's planner: what a change to the planner does to its misses.

Reads every `*.json` the kit wrote under experiments/results/gpu/ (each row's overrides, its measured
nvidia-smi peak and its host peak RSS) and runs the planner on each row's own command line for the card it ran
on. Runs on the CPU.

The host columns: the job's workers' peak RSS (`host_peak_rss_mib`: job/parent.py samples the job process's
descendants, the ranks), against the row's recorded `host_peak_mib` and today's process-RSS prediction for the
card (plan/host_memory.py card_process_prediction: this host's process baseline plus each rank's host terms).

    python benchmarks/gpu/replan.py          # a Markdown table: recorded prediction, today's, measured, ratios
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from zerotune.rundir.plan import Plan, mib_of

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


def as_run_before_the_build_emptied_the_cache(answer: Plan, groups: int) -> float:
    """The run's peak for a row recorded before zerotune emptied the CUDA cache after the engine's build (every row
    without a recorded `param_groups`): what ZeRO-1/2's loading freed (the parameters' own blocks and the
    partition's clone, the phase's `freed_at_end_mib`) stayed reserved under the step. The caching allocator
    places a tensor in a freed block only where it fits. Without offload, the step's peak tensors (the fp32
    gradient partition and Adam's two moments: each one tensor the size of a group's fp32 master partition) are
    larger than the largest freed block (the clone, in the run's dtype), so the two pools add. With offload those
    live on the host, the card's step tensors fit into the freed blocks, and the pool is the larger of the two.
    ZeRO-3's rows: zero3_kept_cache."""
    run_peak = _run_peak(answer)
    phases = {p.phase: p for p in answer.phases}
    loading, step = phases.get("loading"), phases.get("step")
    freed = loading.freed_at_end_mib if loading else None
    if not freed or loading is None or step is None:
        return run_peak
    clone = next((t.mib or 0.0 for t in loading.terms if t.term == "master_partition_clone"), 0.0)
    master = mib_of(t for t in answer.gpu_terms if t.term == "master_weights")
    under_step = step.peak_mib + freed if master / groups > clone else max(step.peak_mib, loading.peak_mib)
    return max(run_peak, under_step)


def _run_peak(answer: Plan) -> float:
    if answer.run_peak_mib is None:
        raise ValueError(f"the plan has no run peak: {answer.error or 'no card named'}")
    return answer.run_peak_mib


def zero3_kept_cache(answer: Plan, overrides: list[str], card) -> float | None:
    """A ZeRO-3 row's run peak with the engine build's cache kept: the step replayed so (zero3_replay.step_terms,
    emptied=False) in place of the plan's step phase, the other phases as planned. None at other stages."""
    from zerotune.config.compose import compose
    from zerotune.config.compose.settle import settle
    from zerotune.plan.command_line import platform_for
    from zerotune.plan.predict import step_peak
    from zerotune.plan.resolve import check
    from zerotune.plan.rules import zero_stage
    from zerotune.plan.zero3_replay import step_terms

    resolved = check(settle(compose(overrides), overrides), platform_for(card))
    if not resolved.use_deepspeed or zero_stage(resolved) != 3:
        return None
    kept = step_terms(resolved.config, resolved, card, emptied=False)
    if kept is None:
        return None
    context = mib_of(t for t in answer.gpu_terms if t.term == "cuda_context")
    others = [p.reserved_mib for p in answer.phases if p.phase != "step"]
    return max([context + step_peak(kept)[0], *others])


def host_cells(row: dict, today: float) -> str:
    """The row's host columns: recorded host prediction, today's, the measured peak RSS and the two ratios."""
    measured = row["measured"].get("host_peak_rss_mib")
    before = (row.get("predicted") or {}).get("host_peak_mib")
    cells = [f"{before:,.0f}" if before else "unrecorded", f"{today:,.0f}",
             f"{measured:,.0f}" if measured else "unmeasured"]
    cells += [f"{v / measured:.3f}" if v and measured else "-" for v in (before, today)]
    return " | ".join(cells)


def main() -> int:
    from zerotune.plan import gpus, host_memory
    from zerotune.plan.command_line import plan_one

    print("| folder | row | card | recorded prediction MiB | today's MiB | nvidia-smi peak MiB | recorded / measured | "
          "today / measured | recorded host MiB | today's host MiB | host peak RSS MiB | recorded host / measured | "
          "today's host / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for card, folder, row in recorded_rows():
        # the job's own overrides, less where the kit put its run and its time limit
        overrides = [o for o in row["overrides"] if not re.match(r"(hydra\.run\.dir|train\.timeout_s)=", o)]
        groups = row.get("param_groups") or 1  # the groups the run's engine was given: 1 before the setting
        if not any(o.startswith("deepspeed.param_groups=") for o in overrides):
            overrides.append(f"deepspeed.param_groups={groups}")
        answer = plan_one(overrides, gpus.lookup(card))
        if "param_groups" in row:
            today = _run_peak(answer)
        else:  # the trainer did not empty the cache after the engine's build yet
            kept = zero3_kept_cache(answer, overrides, gpus.lookup(card))
            today = kept if kept is not None else as_run_before_the_build_emptied_the_cache(answer, groups)
        measured = row["measured"]["gpu_peak_process_mib"]
        before = (row.get("predicted") or {}).get("run_peak_mib")
        recorded, recorded_ratio = (f"{before:,.0f}", f"{before / measured:.3f}") if before else ("unrecorded", "-")
        # the kit's rows run on one node: its ranks are the plan's world
        host = host_memory.card_process_prediction(answer, int(answer.world_size or 1)).host_peak_mib
        print(f"| {folder} | {row['name']} | {card} | {recorded} | {today:,.0f} | {measured:,.0f} | "
              f"{recorded_ratio} | {today / measured:.3f} | "
              f"{host_cells(row, host)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

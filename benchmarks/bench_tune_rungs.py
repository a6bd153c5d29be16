"""Which first-rung length makes tune's pruning reproducible: the same search, run again, keeps the same trials?

    python benchmarks/bench_tune_rungs.py [--workload issue] [--min-steps 4 8 12] [--runs 3] [--grid DIR] [--out FILE]

For each hydra.sweeper.min_steps, the workload's tune command runs --runs times without the finalists' rounds
(`pair_rounds=0`: only the search's pruning is measured). Per length it reports which trials reached the last
rung in each run, how alike those sets are run to run (the mean Jaccard index over the pairs of runs: 1.0 is
the same set every time), and the wall time. With --grid (a folder bench_tune.py kept, `<workload>-grid`),
it also counts the trials stopped early though the grid measured them within 10% of its best: a pruning that
drops those changes which ties can be seen.
Run it on a quiet machine: torch's threads spin, and a second busy process slows a step several times.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
from datetime import datetime
from pathlib import Path

from bench_tune_repro import WORKLOADS, publish, run_once, short_commit, tune_rows

ROOT = Path(__file__).resolve().parents[1]
NEAR = 0.10  # "within the noise of the grid's best": the run-to-run spread measured on this host (tune_noise.md)


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="issue")
    parser.add_argument("--min-steps", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grid", type=Path, default=None, help="bench_tune.py's kept grid folder")
    parser.add_argument("--out", type=Path, default=None, help="also append the report here")
    parser.add_argument("--keep", type=Path, default=None, help="run in this folder and keep every sweep")
    args = parser.parse_args()
    grid = {r["config"]: float(r["samples_per_s"]) for r in tune_rows(args.grid / "sweep")
            if r["status"] == "ok" and r["samples_per_s"]} if args.grid else {}
    near = {c for c, v in grid.items() if v >= max(grid.values()) * (1 - NEAR)} if grid else set()
    load_before = os.getloadavg()[0]
    lines = [f"## {args.workload}: the first rung's length, {datetime.now():%Y-%m-%d %H:%M}, "
             f"{short_commit(ROOT)}"
             f", load average before {load_before:.2f}", "",
             f"command: `zerotune tune {' '.join(WORKLOADS[args.workload])} hydra.sweeper.pair_rounds=0 "
             "hydra.sweeper.min_steps=K`, run " f"{args.runs} times per K", ""]
    if grid:
        lines += [f"The grid ({args.grid}) measured {len(near)} configurations within {NEAR:.0%} of its best.", ""]
    lines += ["| min_steps | rungs reached last (per run) | same set, run to run (mean Jaccard) | "
              "stopped though within 10% of the grid's best (per run) | wall time (per run) |",
              "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="bench-rungs-") as name:
        for k in args.min_steps:
            survivors, dropped_near, walls = [], [], []
            for run in range(args.runs):
                folder = (args.keep or Path(name)) / f"{args.workload}-min{k}-{run}"
                folder.mkdir(parents=True)
                workload = [*WORKLOADS[args.workload], "hydra.sweeper.pair_rounds=0", f"hydra.sweeper.min_steps={k}"]
                _, _, wall = run_once(ROOT, workload, folder)
                found = tune_rows(folder / "sweep")
                survivors.append({r["config"] for r in found if r["status"] == "ok"})
                dropped_near.append(sum(1 for r in found if r["status"] == "pruned" and r["config"] in near))
                walls.append(wall)
                print(f"min_steps={k} run {run + 1}: {wall:.0f} s, {len(survivors[-1])} reached the last rung",
                      flush=True)
            alike = statistics.fmean(jaccard(a, b) for a, b in itertools.combinations(survivors, 2)) \
                if len(survivors) > 1 else 1.0
            lines.append(f"| {k} | {', '.join(str(len(s)) for s in survivors)} | **{alike:.2f}** | "
                         f"{', '.join(map(str, dropped_near)) if grid else 'no grid given'} | "
                         f"{', '.join(f'{w:.0f} s' for w in walls)} |")
    publish("\n".join([*lines, ""]), args.out)


if __name__ == "__main__":
    main()

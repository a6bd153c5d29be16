"""zerotune tune against the grid of the same space: wall time, and whether tune's choice holds up in the grid.

    python benchmarks/bench_tune.py --workload issue|readme [--runs 3] [--out FILE] [--keep DIR] [--grid DIR]

1. tune: the workload's `zerotune tune` command as a user runs it (every default: successive halving, the
   finalists' rounds, warm workers), --runs times (bench_tune_repro.py's runs: what each wrote, its tie set).
2. grid: the same space once, through the same sweeper with nothing stopped (`pruner=none`), no rounds
   (`pair_rounds=0`) and every job's workers started cold (`warm_workers=false`), as `train.py -m` starts
   them. Its jobs are the candidates tune runs trials of (the same screen: invalid and needlessly
   checkpointed ones dropped), each to the warm-up plus 36 timed steps.
   With --grid (a `<workload>-grid` folder an earlier run kept), that grid is read instead of run again: its
   wall time is the one it wrote (`wall_s`), and the report says which grid and when it ran.
Printed (and appended to --out): each tune run's wall time over the grid's, what it wrote, and that
configuration's samples/s in the grid over the grid's best (how much a user gives up by trusting tune).
Run it on a quiet machine: torch's threads spin, and a second busy process slows a step several times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench_tune_repro import WORKLOADS, held, publish, run_once, short_commit, tune_rows

ROOT = Path(__file__).resolve().parents[1]
WALL = "wall_s"  # the grid's wall time, in its folder
# Each configuration measured once over 36 timed steps: as long as a tune finalist's three rounds together (tune's
# own search stops at 12, since the rounds are its measurement).
GRID = ["hydra.sweeper.pruner=none", "hydra.sweeper.pair_rounds=0", "hydra.sweeper.warm_workers=false",
        "hydra.sweeper.max_steps=36"]


def grid(workload: list[str], folder: Path) -> tuple[dict[str, float], float]:
    """The grid's samples/s by configuration (label as tune.md writes it), and its wall time."""
    folder.mkdir(parents=True)
    cmd = [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "train.py"), "-m", "hydra/sweeper=tune", *workload,
           *GRID, f"hydra.sweep.dir={folder / 'sweep'}", "hydra.sweeper.name=grid"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (folder / "grid.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    (folder / WALL).write_text(f"{wall:.1f}\n")
    return kept_grid(folder)


def kept_grid(folder: Path) -> tuple[dict[str, float], float]:
    """A grid an earlier run kept: its samples/s by configuration, and the wall time it wrote."""
    if not (folder / WALL).is_file():
        sys.exit(f"{folder / WALL} is missing: give --grid a <workload>-grid folder that bench_tune.py kept")
    wall = float((folder / WALL).read_text())
    rows = tune_rows(folder / "sweep")
    return {r["config"]: float(r["samples_per_s"]) for r in rows if r["status"] == "ok" and r["samples_per_s"]}, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="issue")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also append the report here")
    parser.add_argument("--keep", type=Path, default=None, help="run in this folder and keep every sweep")
    parser.add_argument("--grid", type=Path, default=None, help="read this kept grid folder instead of running one")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as name:
        base = args.keep or Path(name)
        runs, held_shares = [], []
        for run in range(args.runs):
            folder = base / f"{args.workload}-tune-{run}"
            folder.mkdir(parents=True)
            runs.append(run_once(ROOT, workload, folder))
            held_shares.append(held((folder / "sweep" / "tune.md").read_text()))
            print(f"tune run {run + 1}: {runs[-1][2]:.0f} s, wrote {runs[-1][0]}", flush=True)
        if args.grid:
            figures, grid_wall = kept_grid(args.grid)
            grid_from = (f" (not run again: read from {args.grid}, run "
                         f"{datetime.fromtimestamp((args.grid / 'grid.log').stat().st_mtime):%Y-%m-%d %H:%M})")
        else:
            figures, grid_wall = grid(workload, base / f"{args.workload}-grid")
            grid_from = ""
        print(f"grid: {grid_wall:.0f} s, {len(figures)} configurations measured{grid_from}", flush=True)
    best_config, best = max(figures.items(), key=lambda item: item[1])
    lines = [f"## {args.workload}: tune against the grid, {datetime.now():%Y-%m-%d %H:%M}, {short_commit(ROOT)}, "
             f"{len(os.sched_getaffinity(0))} cores, load average before {load_before:.2f}", "",
             f"command: `zerotune tune {' '.join(workload)}`; grid: the same with `{' '.join(GRID)}`", "",
             f"grid{grid_from}: **{grid_wall:.0f} s**, {len(figures)} configurations to the last rung; its best "
             f"{best:.4g} samples/s, {best_config}", "",
             "| tune run | wall time | / grid's | written | in the grid: its samples/s / the grid's best | tie set | "
             "its rounds drawn again: written |", "|---|---|---|---|---|---|---|"]
    for i, (chosen, tied, wall) in enumerate(runs):
        measured = figures.get(chosen)
        share = f"{measured / best:.3f}" if measured else "not measured in the grid"
        lines.append(f"| {i + 1} | {wall:.0f} s | **{wall / grid_wall:.3f}** | {chosen} | {share} | "
                     f"{len(tied) or '-'}{' (the grid best among them)' if best_config in tied else ''} | {held_shares[i]} |")
    walls = [wall for _, _, wall in runs]
    lines += ["", f"- tune's wall time over the grid's: median **{statistics.median(walls) / grid_wall:.3f}** "
              f"(range {min(walls) / grid_wall:.3f}-{max(walls) / grid_wall:.3f})", ""]
    publish("\n".join(lines), args.out)


if __name__ == "__main__":
    main()

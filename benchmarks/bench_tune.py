"""zerotune tune against the exhaustive grid over the same space, and the README's configuration.

    python benchmarks/bench_tune.py [--max-steps 36] [--pairs 2] [--out experiments/results/tune.md]

The workload: model=sdxl_tiny data=synthetic resolution=64 at a global batch of 32, on this machine.
1. tune: the space below, Optuna's successive halving (3 warm-up steps, then rungs of 4, 12, ... timed steps up
   to --max-steps), the planner dropping what cannot fit or would checkpoint needlessly.
2. grid: the same space, every candidate the validator accepts, each run to --max-steps: the same jobs through
   the same sweeper with nothing stopped or dropped (hydra.sweeper.pruner=none drop_by_plan=false).
3. The README's `zero_stage=2 offload=cpu` at the same global batch (train.batch_size=32), against the tuned
   winner, in --pairs alternating pairs of one-candidate runs of --max-steps timed steps each.
Printed (and written to --out): the best samples/s each search finds, the wall time each takes, their ratios.
Run it on a quiet machine: torch's threads spin, and a second busy process slows a step several times.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ["model=sdxl_tiny", "data=synthetic", "resolution=64", "hydra.sweeper.global_batch=32"]
SPACE = ["zero_stage=0,2", "offload=none,cpu", "train.gradient_checkpointing=false,true",
         "launch.num_processes=1", "deepspeed.overlap_comm=false"]  # train.batch_size: auto (32, 16, 8)
README_CONFIG = ["zero_stage=2", "offload=cpu", "train.batch_size=32", "train.gradient_checkpointing=false",
                 "launch.num_processes=1", "deepspeed.overlap_comm=false"]


def sweep(args: list[str], folder: Path, max_steps: int, env: dict) -> tuple[list[dict], float]:
    """One tune sweep; its tune.csv rows and its wall time (the whole command)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "hydra/sweeper=tune", *WORKLOAD, *args,
           f"hydra.sweeper.max_steps={max_steps}", f"hydra.sweeper.min_steps={min(4, max_steps)}",
           "hydra.sweeper.name=bench", f"hydra.sweep.dir={folder}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=folder.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    with open(folder / "tune.csv") as f:
        return list(csv.DictReader(f)), wall


def best(rows: list[dict]) -> dict:
    complete = [r for r in rows if r["status"] == "ok" and r["samples_per_s"]]
    return max(complete, key=lambda r: float(r["samples_per_s"]))


def pairs(winner: dict, n: int, max_steps: int, tmp: Path, env: dict) -> tuple[list[float], list[float]]:
    """Alternating one-candidate runs of the winner and the README's configuration: samples/s of each."""
    tuned = [*winner["config"].split(), f"train.grad_accum={winner['grad_accum']}"]
    mine, readme = [], []
    for i in range(n):
        for config, into in ((tuned, mine), (README_CONFIG, readme)):
            rows, _ = sweep([*config, "hydra.sweeper.pruner=none"], tmp / f"pair-{i}-{len(into)}-{id(into)}",
                            max_steps, env)
            into.append(float(best(rows)["samples_per_s"]))
    return mine, readme


def report(tune: tuple, grid: tuple, mine: list[float], readme: list[float], max_steps: int) -> str:
    (tune_rows, tune_wall), (grid_rows, grid_wall) = tune, grid
    t, g = best(tune_rows), best(grid_rows)
    ran = sum(1 for r in tune_rows if r["run_dir"])
    lines = [f"# zerotune tune: {datetime.now():%Y-%m-%d %H:%M}, {len(os.sched_getaffinity(0))} cores, "
             f"load average before {LOAD_BEFORE:.2f}", "",
             f"workload: {' '.join(WORKLOAD)}; space: {' '.join(SPACE)}"
             f"{'' if any(k.startswith('train.batch_size=') for k in SPACE) else ' train.batch_size=auto'}; "
             f"{max_steps} timed steps after 3 warm-up", "",
             "| search | candidates run | best samples/s | its configuration | wall time |", "|---|---|---|---|---|",
             f"| tune | {ran} of {len(tune_rows)} | {float(t['samples_per_s']):.4g} | {t['config']} | {tune_wall:.0f} s |",
             f"| grid | {sum(1 for r in grid_rows if r['run_dir'])} of {len(grid_rows)} | "
             f"{float(g['samples_per_s']):.4g} | {g['config']} | {grid_wall:.0f} s |", "",
             f"- tune's best / grid's best: **{float(t['samples_per_s']) / float(g['samples_per_s']):.3f}**",
             f"- tune's wall time / grid's: **{tune_wall / grid_wall:.3f}**"]
    if mine:
        lines += [f"- tuned against the README's `zero_stage=2 offload=cpu train.batch_size=32`, {len(mine)} "
                  f"alternating pairs: {statistics.median(mine):.4g} against {statistics.median(readme):.4g} "
                  f"samples/s (medians; rounds {', '.join(f'{a:.4g}/{b:.4g}' for a, b in zip(mine, readme, strict=True))}), "
                  f"ratio **{statistics.median(mine) / statistics.median(readme):.3f}**"]
    return "\n".join(lines) + "\n"


LOAD_BEFORE = os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=36)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--space", nargs="+", default=SPACE, help="the knobs' values (default: %(default)s)")
    args = parser.parse_args()
    SPACE[:] = args.space
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as name:
        tmp = Path(name)
        tune = sweep(SPACE, tmp / "tune", args.max_steps, env)  # SPACE: --space's
        print(f"tune: {tune[1]:.0f} s, best {best(tune[0])['samples_per_s']} ({best(tune[0])['config']})", flush=True)
        grid = sweep([*SPACE, "hydra.sweeper.pruner=none", "hydra.sweeper.drop_by_plan=false"], tmp / "grid",
                     args.max_steps, env)
        print(f"grid: {grid[1]:.0f} s, best {best(grid[0])['samples_per_s']} ({best(grid[0])['config']})", flush=True)
        mine, readme = pairs(best(tune[0]), args.pairs, args.max_steps, tmp, env)
        text = report(tune, grid, mine, readme, args.max_steps)
        for label in ("tune", "grid"):
            text += f"\n## {label}: every candidate\n\n" + (tmp / label / "tune.md").read_text().split("\n\n", 3)[-1]
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

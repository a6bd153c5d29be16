"""Step time by intra-op threads per worker, for 1 and 2 workers, on a quiet machine and beside one busy core.

    python benchmarks/bench_threads.py [--steps 30] [--threads 1 2 auto] [--procs 1 2]

Each cell is one zerotune job (the default tiny U-Net, ZeRO-2, fp32, batch 64) with `launch.threads=T`;
"busy core" runs a pure-Python spinning process beside it, the way a second tenant would. Printed: the
median step time (s) per cell, and which thread count was fastest per row. This is what launch.threads=auto
(train/distributed.py) is checked against.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def step_time(run_dir: Path, steps: int, procs: int, threads: str, env: dict) -> tuple[float, int]:
    cmd = [sys.executable, "train.py", f"train.max_steps={steps}", f"launch.num_processes={procs}",
           f"launch.threads={threads}", "evaluate.enabled=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["perf"]["step_time_median_s"], summary["threads"]["intra_op"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", nargs="+", default=["1", "2", "auto"])
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_NUM_THREADS", None)
    print(f"cores available: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.2f}, "
          f"{args.steps} steps per job\n")
    print(f"| workers | beside | {' | '.join(f'threads={t}' for t in args.threads)} | fastest |")
    print(f"|---|---|{'---|' * len(args.threads)}---|")
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        for procs in args.procs:
            for busy in (False, True):
                spinner = multiprocessing.Process(target=spin, daemon=True) if busy else None
                if spinner:
                    spinner.start()
                try:
                    cells = {t: step_time(Path(tmp) / f"{procs}-{busy}-{t}", args.steps, procs, t, env)
                             for t in args.threads}
                finally:
                    if spinner:
                        spinner.terminate()
                text = [f"{s:.3f} s ({n} thr)" for s, n in cells.values()]
                fastest = min(cells, key=lambda t: cells[t][0])
                print(f"| {procs} | {'one busy core' if busy else 'quiet'} | {' | '.join(text)} | {fastest} |",
                      flush=True)


if __name__ == "__main__":
    main()

"""How long planning takes: one SDXL job (1024 px, batch 8) from a cold cache, and the 36 jobs of the
`stage_resolution_batch` sweep planned without training (plan.only=true), as a user runs them.

Targets: one job <= 60 s, the sweep <= 5 min, on 2 cores. Each figure is the wall time of the real
command, in a fresh cache folder (ZEROTUNE_CACHE_DIR), so traces are computed, not read.

    python benchmarks/bench_plan.py [--skip-sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cache: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "ZEROTUNE_CACHE_DIR": cache}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc


def one_job(cache: str) -> None:
    cmd = [sys.executable, "-m", "zerotune", "plan", "experiment=sdxl_4090_1024_bs8", "--gpu", "rtx4090", "--json"]
    cold, proc = timed(cmd, cache)
    warm, _ = timed(cmd, cache)
    plan = json.loads(proc.stdout)
    print(f"one SDXL job (1024 px, batch 8): {cold:.1f} s cold (target 60 s, ratio {cold / 60:.2f}), "
          f"{warm:.1f} s with its trace cached; predicted GPU peak {plan['gpu_peak_mib']:,.0f} MiB")


def sweep(cache: str, out: str) -> None:
    cmd = [sys.executable, "train.py", "-m", "experiment=stage_resolution_batch", "plan.only=true",
           "plan.gpu=rtx4090", f"hydra.sweep.dir={out}"]
    seconds, _ = timed(cmd, cache)
    jobs = sorted(Path(out).glob("*/summary.json"))
    planned = sum(json.loads(p.read_text())["status"] == "planned" for p in jobs)
    print(f"stage_resolution_batch sweep, plan.only: {len(jobs)} jobs ({planned} planned) in {seconds:.1f} s "
          f"(target 300 s, ratio {seconds / 300:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out:
        one_job(cache)
        if not args.skip_sweep:
            sweep(tempfile.mkdtemp(dir=cache), out)


if __name__ == "__main__":
    main()

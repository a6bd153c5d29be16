"""DeepSpeed's CPU-Adam per parameter at three sizes: the old probe (4M), the planner's probe, and 200M.

    python benchmarks/bench_cpu_adam.py [--repeats 3]

Each size is one real DeepSpeedCPUAdam step over that many fp32 parameters (with fp32 gradients), timed as the
median of `--repeats` steps after a warm-up step (plan/cpu_optimizer.py's time_step). The planner's probe
(cpu_optimizer.probe_params) should time within 10% of the 200M step: the ratio probe / 200M is printed last.
Torch's threads spin, so run it on a quiet machine (check `uptime`) and more than once.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from zerotune.plan import cpu_optimizer

OLD_PROBE, LARGE = 4_000_000, 200_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    probe = cpu_optimizer.probe_params()
    llc = cpu_optimizer.last_level_cache_bytes()
    print(f"host {platform.node()} ({platform.processor() or platform.machine()}), {torch.get_num_threads()} "
          f"threads, LLC {llc / 2**20 if llc else float('nan'):.0f} MiB, load {os.getloadavg()[0]:.2f}")
    figures = {}
    for label, size in (("old probe", OLD_PROBE), ("probe", probe), ("200M", LARGE)):
        seconds = cpu_optimizer.time_step(size, args.repeats)
        figures[label] = seconds
        shown = "unmeasured (no CPU-Adam op)" if seconds is None else f"{seconds * 1e9:.3f} ns/param"
        print(f"{label:>9} {size / 1e6:7.1f}M params ({size * 4 / 2**20:6.0f} MiB fp32): {shown}")
    if figures["probe"] and figures["200M"]:
        print(f"ratio probe / 200M: {figures['probe'] / figures['200M']:.3f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

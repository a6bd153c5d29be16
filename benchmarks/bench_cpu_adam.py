"""DeepSpeed's CPU-Adam per parameter at three sizes: the old probe (4M), the planner's probe, and 200M.

    python benchmarks/bench_cpu_adam.py [--repeats 3]

Each size is a real DeepSpeedCPUAdam over that many fp32 parameters (with fp32 gradients; plan/cpu_optimizer.py's
build_optimizer), given one warm-up step, then `--repeats` timed steps. The sizes take their steps in turns
(4M, probe, 200M, 4M, ...), so a load that comes and goes during the run weighs on all three alike. Printed per
size: the median step per parameter (what the planner's probe takes) and the fastest. The planner's probe
(cpu_optimizer.probe_params) should time within 10% of the 200M step: the ratio of medians probe / 200M is
printed last. Torch's threads spin, so run it on a quiet machine (check `uptime`) and more than once.
About 4.5 GiB of memory at its peak.
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
    sizes = {"old probe": OLD_PROBE, "probe": cpu_optimizer.probe_params(), "200M": LARGE}
    llc = cpu_optimizer.last_level_cache_bytes()
    print(f"host {platform.node()} ({platform.processor() or platform.machine()}), {torch.get_num_threads()} "
          f"threads, LLC {llc / 2**20 if llc else float('nan'):.0f} MiB, load {os.getloadavg()[0]:.2f}")
    optimizers = {label: cpu_optimizer.build_optimizer(n) for label, n in sizes.items()}
    if any(o is None for o in optimizers.values()):
        raise SystemExit("DeepSpeed's CPU-Adam op cannot be built here: nothing to time")
    for optimizer in optimizers.values():
        optimizer.step()  # warm-up: allocates the moments
    times: dict[str, list[float]] = {label: [] for label in sizes}
    for _ in range(args.repeats):
        for label, optimizer in optimizers.items():
            times[label].append(cpu_optimizer.timed_step(optimizer) / sizes[label])
    median = {label: sorted(t)[len(t) // 2] for label, t in times.items()}
    for label, n in sizes.items():
        print(f"{label:>9} {n / 1e6:7.1f}M params ({n * 4 / 2**20:6.0f} MiB fp32): median {median[label] * 1e9:.3f} "
              f"ns/param, fastest {min(times[label]) * 1e9:.3f}")
    print(f"ratio probe / 200M (medians): {median['probe'] / median['200M']:.3f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

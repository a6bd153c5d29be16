"""What does MemorySampler cost a training step?

Times a CPU-bound "step" (~0.3 s) with and without the sampler running at its default interval, alternating
the two (ABAB...) so that drift (thermal, other tenants) hits both equally, and prints both medians, the
ratio and the sampler's own per-sample cost. Target: overhead <= 2%.

    python benchmarks/bench_telemetry_overhead.py [--reps 15] [--workload torch|python] [--step-s 0.3]

`torch` (default) is a matmul loop, like a training step on CPU: it releases the GIL and keeps every core
busy, so the sampler competes for CPU time. `python` is a pure-Python loop holding the GIL: the sampler's
Python code must take the GIL from it, the worst case for a thread in the trainer's process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from zerotune.host.memory import DEFAULT_INTERVAL_S, MemorySampler


def torch_workload(threads: int) -> Callable[[int], None]:
    import torch

    # One intra-op thread by default: on a shared, oversubscribed box OpenMP barriers between descheduled
    # threads add multi-ms stalls that swamp the effect being measured.
    torch.set_num_threads(threads)

    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def run(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    return run


def python_workload() -> Callable[[int], None]:
    def run(n: int) -> None:
        acc = 0
        for i in range(n * 1000):
            acc += i * i % 7

    return run


def calibrate(run: Callable[[int], None], step_s: float) -> int:
    """Iterations that take about step_s, from the fastest of several timed batches (robust to stalls)."""
    run(1)  # the first call pays one-off costs (thread pool start, page faults): keep it out of the estimate
    k = 1
    while time_step(run, k) < 0.02:
        k *= 2
    per_iter = min(time_step(run, k) for _ in range(5)) / k
    return max(1, round(step_s / per_iter))


def time_step(run: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter()
    run(n)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--workload", choices=["torch", "python"], default="torch")
    ap.add_argument("--step-s", type=float, default=0.3)
    ap.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()

    run = torch_workload(args.threads) if args.workload == "torch" else python_workload()
    n = calibrate(run, args.step_s)
    time_step(run, n)  # warm-up (allocator, caches)

    # A B A' triplets: B (sampler on) is compared with the mean of its two neighbours, which cancels linear
    # drift; A'/A (both off) is the noise floor of this machine.
    base, sampled, base2, wall_ms, cpu_ms, samples = [], [], [], [], [], 0
    for _ in range(args.reps):
        base.append(time_step(run, n))
        s = MemorySampler(interval_s=args.interval_s).start()  # start()/stop() are outside the timed region
        sampled.append(time_step(run, n))
        s.stop()
        base2.append(time_step(run, n))
        st = s.stats()
        wall_ms.append(st["mean_sample_ms"])
        cpu_ms.append(st["mean_sample_cpu_ms"])
        samples += st["samples"]

    off = base + base2
    m0, m1 = statistics.median(off), statistics.median(sampled)
    paired = statistics.median(b / ((a + c) / 2) for a, b, c in zip(base, sampled, base2, strict=True))
    noise = statistics.median(c / a for a, c in zip(base, base2, strict=True))
    spread = statistics.quantiles([c / a for a, c in zip(base, base2, strict=True)], n=4)
    print(f"workload={args.workload} threads={args.threads} step~{args.step_s}s iterations={n} reps={args.reps} "
          f"interval={args.interval_s * 1e3:.0f}ms cpus={os.cpu_count()} load1={os.getloadavg()[0]:.1f}")
    print(f"median step without sampler: {m0 * 1e3:8.2f} ms  (min {min(off) * 1e3:.2f})")
    print(f"median step with sampler:    {m1 * 1e3:8.2f} ms  (min {min(sampled) * 1e3:.2f})")
    print(f"ratio of medians with/without: {m1 / m0:.4f}  -> overhead {100 * (m1 / m0 - 1):+.2f}%  (target <= +2%)")
    print(f"median paired ratio B/mean(A,A'): {paired:.4f}  -> overhead {100 * (paired - 1):+.2f}%")
    print(f"noise floor A'/A (both off): median {noise:.4f}, IQR {spread[0]:.4f}..{spread[2]:.4f}")
    cpu = statistics.median(cpu_ms)
    print(f"sampler: {samples} samples, median {statistics.median(wall_ms):.3f} ms wall / {cpu:.3f} ms CPU per "
          f"sample = {100 * cpu / 1e3 / args.interval_s:.2f}% of one core at this interval")

if __name__ == "__main__":
    main()

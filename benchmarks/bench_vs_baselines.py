"""zerotune against the loops people write by hand, given exactly the same work.

    python benchmarks/bench_vs_baselines.py [--pairs 5] [--steps 200] [--offload none cpu] [--procs 1 2]
                                            [--json out.json] [-- extra zerotune overrides]

For each offload x process count: one zerotune job (`python train.py`, the default tiny U-Net, ZeRO-2, fp32,
batch 64), then the two baselines (benchmarks/baselines/) reading that job's config.yaml and ds_config.json,
in interleaved rounds (the order rotates each round, so drift hits every program alike). Each round asserts
the three first losses equal. Printed per program: medians of the step time, whole-process wall time, time
from the command's start to the end of its first step, CPU time of the process tree, and peak memory (RSS of
the whole tree and of its largest process; PSS of the whole tree, which counts shared pages once); then the
ratios zerotune/raw and zerotune/accelerate.

Run it on a quiet machine: torch's intra-op threads spin, so one other busy process slows a step 5-10x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "benchmarks" / "baselines"
PROGRAMS = ("zerotune", "raw", "accelerate")
METRICS = (("step_s", "step time, median (s)"), ("wall_s", "whole process, wall (s)"),
           ("first_step_s", "command start -> first step done (s)"), ("cpu_s", "CPU time, process tree (s)"),
           ("rss_tree_mib", "peak RSS, process tree (MiB)"), ("rss_max_mib", "peak RSS, largest process (MiB)"),
           ("pss_tree_mib", "peak PSS, process tree (MiB)"))


class TreeMemory:
    """Peak memory of a process tree, sampled at 20 Hz: RSS summed and per process, and every 4th sample PSS
    summed (each shared page counted once across the tree: torch's libraries, mapped by every process, are
    not counted twice; reading it costs ~4 ms a process, hence the lower rate)."""

    def __init__(self, pid: int) -> None:
        self.root, self.tree_peak, self.proc_peak, self.pss_peak = psutil.Process(pid), 0, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._done.wait(0.05):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            rss, pss = [], []
            for proc in procs:
                try:
                    rss.append(proc.memory_info().rss)
                    if tick % 4 == 0:
                        pss.append(proc.memory_full_info().pss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            tick += 1
            self.tree_peak, self.proc_peak = max(self.tree_peak, sum(rss)), max([self.proc_peak, *rss])
            self.pss_peak = max(self.pss_peak, sum(pss))

    def stop(self) -> tuple[float, float, float]:
        self._done.set()
        self._thread.join()
        return self.tree_peak / 2**20, self.proc_peak / 2**20, self.pss_peak / 2**20


def measure(cmd: list[str], env: dict, log: Path) -> dict:
    """Run one command to its end: wall, CPU of the whole (waited-for) tree, memory, its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        memory = TreeMemory(proc.pid)
        code = proc.wait()
    wall = time.time() - start
    rss_tree, rss_max, pss_tree = memory.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} exited {code}; its output: {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"start": start, "wall_s": wall, "cpu_s": cpu, "rss_tree_mib": rss_tree, "rss_max_mib": rss_max,
            "pss_tree_mib": pss_tree}


def run_zerotune(run_dir: Path, args, offload: str, procs: int, env: dict) -> dict:
    cmd = [sys.executable, "train.py", f"train.max_steps={args.steps}", f"offload={offload}",
           f"launch.num_processes={procs}", "evaluate.enabled=false", f"hydra.run.dir={run_dir}", *args.overrides]
    result = measure(cmd, env, run_dir.with_suffix(".log"))
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    perf = summary["perf"]
    return {**result, "step_s": perf["step_time_median_s"], "first_step_s": perf["first_step_end_unix"] - result["start"],
            "first_loss": next(r["loss/train"] for r in rows if r["step"] == 1)}


def run_baseline(name: str, run_dir: Path, args, procs: int, env: dict, out: Path) -> dict:
    script = str(BASELINES / f"{'raw_deepspeed' if name == 'raw' else 'accelerate'}_loop.py")
    launch = [sys.executable, script] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", script]
    log = out / f"{name}.log"
    result = measure([*launch, str(run_dir), f"--steps={args.steps}"], env, log)
    line = [ln for ln in log.read_text().splitlines() if ln.startswith('{"first_loss"')][-1]
    record = json.loads(line)
    return {**result, "step_s": record["step_time_median_s"], "first_loss": record["first_loss"],
            "first_step_s": record["first_step_end_unix"] - result["start"], "threads": record["threads"]}


def one_round(index: int, args, offload: str, procs: int, work: Path, env: dict) -> dict:
    order = PROGRAMS[index % 3:] + PROGRAMS[:index % 3]
    out = work / f"{offload}-{procs}-r{index}"
    out.mkdir(parents=True)
    # The baselines read the job's effective config and DeepSpeed dict; a plan-only job writes them untimed.
    subprocess.run([sys.executable, "train.py", f"train.max_steps={args.steps}", f"offload={offload}",
                    f"launch.num_processes={procs}", "evaluate.enabled=false", "plan.only=true",
                    f"hydra.run.dir={out / 'plan'}", *args.overrides], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    results = {name: (run_zerotune(out / "zerotune", args, offload, procs, env) if name == "zerotune"
                      else run_baseline(name, out / "plan", args, procs, env, out)) for name in order}
    losses = {name: r["first_loss"] for name, r in results.items()}
    if max(losses.values()) - min(losses.values()) > 1e-6 * abs(losses["zerotune"]):
        sys.exit(f"the programs did not do the same work: first losses {losses}")
    return results


def table(rounds: list[dict]) -> tuple[str, dict]:
    medians = {p: {k: statistics.median(r[p][k] for r in rounds) for k, _ in METRICS} for p in PROGRAMS}
    lines = [f"| | {' | '.join(PROGRAMS)} | zerotune/raw | zerotune/accelerate |", "|---|---|---|---|---|---|"]
    for key, label in METRICS:
        z, r, a = (medians[p][key] for p in PROGRAMS)
        lines.append(f"| {label} | {z:.3f} | {r:.3f} | {a:.3f} | {z / r:.3f} | {z / a:.3f} |")
    lines.append(f"| first step over raw (s) | {medians['zerotune']['first_step_s'] - medians['raw']['first_step_s']:+.2f}"
                 " | | | | |")
    return "\n".join(lines), medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="interleaved rounds per configuration")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--offload", nargs="+", default=["none", "cpu"])
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="more zerotune overrides (after --)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_NUM_THREADS", None)  # each program chooses its own threads, as it would for a user
    report = {"args": vars(args) | {"json": str(args.json)}, "load_average_before": os.getloadavg(), "configs": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-baselines-"))  # kept when a program fails: its logs are there
    for offload in args.offload:
        for procs in args.procs:
            rounds = [one_round(i, args, offload, procs, tmp, env) for i in range(args.pairs)]
            text, medians = table(rounds)
            print(f"\n## offload={offload}, launch.num_processes={procs}: {args.pairs} rounds x {args.steps} "
                  f"steps, load average {os.getloadavg()[0]:.2f}\n\n{text}", flush=True)
            report["configs"][f"{offload}-{procs}"] = {"medians": medians, "rounds": rounds}
    shutil.rmtree(tmp)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

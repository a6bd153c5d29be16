"""How often the same `zerotune tune` command names the same configuration (or the same tie set).

    python benchmarks/bench_tune_repro.py --workload issue --runs 3 [--checkout DIR] [--out FILE]

Runs the workload's tune command --runs times, one after another, and prints, per run, what it wrote (the
chosen configuration), the tie set where it named one, and its wall time; then how many runs agree with the
most common answer. --checkout runs another checkout's `train.py` with its own venv (an earlier commit, for a
before/after comparison). Run it on a quiet machine: a second busy process changes what is measured.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # the command of the issue that asked for this: a workload no other benchmark here uses
    "issue": ["model=tiny", "data=synthetic", "resolution=16", "precision=fp32", "evaluate.enabled=false",
              "launch.num_processes=1", "zero_stage=0,1,2", "offload=none,cpu", "train.batch_size=4,8,16",
              "hydra.sweeper.global_batch=16"],
    # the README's
    "readme": ["model=sdxl_tiny", "data=synthetic", "resolution=64", "hydra.sweeper.global_batch=32"],
}


def answer(tune_md: str) -> tuple[str, tuple[str, ...]]:
    """(the configuration written, the tie set or ()) from tune.md's answer line; older reports name only the
    fastest."""
    line = next(line for line in tune_md.splitlines() if line.startswith("**"))
    if line.startswith("**No candidate"):
        return "(none: no candidate completed)", ()
    if line.startswith("**tie among"):
        tied = re.search(r"samples/s\): (.*)\. Chosen", line)
        chosen = re.search(r"lowest stage\): (.*?)(?:; its rounds, drawn again|; the search could not tell|\*\*)",
                           line)
        assert tied and chosen, line
        members = tuple(sorted(re.sub(r" \([0-9.e+]+\)$", "", m) for m in tied.group(1).split("; ")))
        return chosen.group(1), members
    won = re.match(r"\*\*(?:winner|Fastest): (.*?)(?:, [0-9.]+ samples/s| \(grad_accum)", line)
    assert won, line
    return won.group(1), ()


def held(tune_md: str) -> str:
    """How often the chosen one's rounds, drawn again, write it (finalists.resampled_choices), from the answer
    line; '-' where tune.md does not say (no rounds, or an older report)."""
    share = re.search(r"drawn again [0-9,]+ times, write it in ([0-9]+%)", tune_md)
    return share.group(1) if share else "-"


def short_commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def publish(text: str, out: Path | None) -> None:
    """Print a report, and append it to `out` where given."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


def tune_rows(sweep: Path) -> list[dict]:
    """A tune sweep's tune.csv: a row per candidate."""
    with open(sweep / "tune.csv") as f:
        return list(csv.DictReader(f))


def run_once(checkout: Path, workload: list[str], folder: Path) -> tuple[str, tuple[str, ...], float]:
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), str(checkout / "train.py"), "-m", "hydra/sweeper=tune", *workload,
           f"hydra.sweep.dir={folder / 'sweep'}", "hydra.sweeper.name=repro"]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (folder / "tune.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    chosen, tied = answer((folder / "sweep" / "tune.md").read_text())
    return chosen, tied, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="issue")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--checkout", type=Path, default=ROOT)
    parser.add_argument("--out", type=Path, default=None, help="also append the report here")
    parser.add_argument("--keep", type=Path, default=None, help="run in this folder and keep every sweep")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-repro-") as name:
        for run in range(args.runs):
            folder = (args.keep or Path(name)) / f"{args.workload}-{run}"
            folder.mkdir(parents=True)
            results.append(run_once(args.checkout.resolve(), workload, folder))
            chosen, tied, wall = results[-1]
            print(f"run {run + 1}: {wall:.0f} s, wrote {chosen}" + (f"; tie among {' | '.join(tied)}" if tied else ""),
                  flush=True)
    written = collections.Counter(chosen for chosen, _, _ in results)
    sets = collections.Counter(tied or (chosen,) for chosen, tied, _ in results)
    common, agree = written.most_common(1)[0]
    lines = [f"## {args.workload}: {args.runs} runs, {datetime.now():%Y-%m-%d %H:%M}, checkout {args.checkout.resolve()}"
             f" ({short_commit(args.checkout)}),"
             f" load average before {LOAD_BEFORE:.2f}", "",
             f"command: `zerotune tune {' '.join(workload)}`", "",
             "| run | wall time | written | tie set |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {wall:.0f} s | {chosen} | {' / '.join(tied) if tied else '-'} |"
              for i, (chosen, tied, wall) in enumerate(results)]
    lines += ["", f"- the same configuration written in **{agree} of {args.runs}** runs ({common})",
              f"- the same answer (tie set, or the one configuration) in **{sets.most_common(1)[0][1]} of "
              f"{args.runs}** runs", ""]
    publish("\n".join(lines), args.out)


LOAD_BEFORE = os.getloadavg()[0]

if __name__ == "__main__":
    main()

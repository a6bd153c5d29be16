"""The planner's whole-step peak (`--device cpu`) against what torch really allocates on this CPU for the
same step (benchmarks/step_alloc.py: forward, backward and the optimizer's step, zerotune's own trainer,
one rank): models x ZeRO stages x offload x precision. The criterion is the ratio within [0.9, 1.1].

    python benchmarks/bench_plan_step.py [--models tiny,sdxl_tiny] [--stages 0,1,2,3] [--offloads none,cpu]
        [--precisions fp32,bf16] [--measured FILE.jsonl]

Each measurement runs in its own process (DeepSpeed's state is global), 15-60 s each on 2 cores; the
whole grid (28 configurations: stage 0 takes no offload) about 15 minutes. `--measured`: reuse the JSON
lines step_alloc.py printed instead of running it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerotune.rundir.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def configs(models, stages, offloads, precisions) -> list[tuple]:
    return [(m, s, o, p) for m, p, s, o in product(models, precisions, stages, offloads) if not (s == 0 and o != "none")]


def _args(config: tuple) -> list[str]:
    model, stage, offload, precision = config
    return [f"model={model}", f"zero_stage={stage}", f"offload={offload}", f"precision={precision}"]


def measured(config: tuple, cache: dict) -> dict:
    """step_alloc.py's figures for one configuration (from `cache` when it holds them)."""
    key = " ".join(_args(config))
    if key not in cache:
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_alloc.py"), *_args(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"step_alloc.py {key} printed no figures:\n{out.stderr[-3000:]}")
        cache[key] = json.loads(lines[-1])
    return cache[key]


def predicted(config: tuple) -> Plan:
    """The planner's CPU prediction of the same job (the same overrides step_alloc.py composes)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.step_alloc import QUICK, RESOLUTION
    from zerotune.config.compose import compose
    from zerotune.config.compose.settle import settle
    from zerotune.plan.predict import predict
    from zerotune.plan.resolve import check

    overrides = [*QUICK, f"resolution={RESOLUTION[config[0]]}", *_args(config)]
    cfg = compose(overrides)
    return predict(check(settle(cfg, overrides, 1)), None, device="cpu")


def compare(config: tuple, cache: dict) -> dict:
    real, plan = measured(config, cache), predicted(config)
    peak = float(plan.step_peak_mib or 0.0) * MIB
    return {"config": config, "predicted": peak, "moment": plan.step_peak_moment,
            "measured": real["peak_between_ops"], "held": real["held_at_start"],
            "ratio": peak / real["peak_between_ops"], "optimizer": real["optimizer_class"]}


def _cache(path: str | None) -> dict:
    found = {}
    for line in Path(path).read_text().splitlines() if path else []:
        if line.startswith("{"):
            entry = json.loads(line)
            found[" ".join(a for a in entry["overrides"] if a.split("=")[0] in
                           ("model", "zero_stage", "offload", "precision"))] = entry
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,sdxl_tiny")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--offloads", default="none,cpu")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--measured", default=None, help="step_alloc.py's JSON lines, to reuse")
    a = ap.parse_args(argv)
    cache = _cache(a.measured)
    rows = [compare(c, cache) for c in configs(a.models.split(","), [int(s) for s in a.stages.split(",")],
                                               a.offloads.split(","), a.precisions.split(","))]
    print("| model | stage | offload | precision | optimizer | held at step start B | measured peak B | "
          "predicted B | predicted moment | ratio |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        model, stage, offload, precision = r["config"]
        print(f"| {model} | {stage} | {offload} | {precision} | {r['optimizer']} | {r['held']:,} | {r['measured']:,} | "
              f"{r['predicted']:,.0f} | {r['moment']} | {r['ratio']:.3f} |")
    bad = [r for r in rows if not 0.9 <= r["ratio"] <= 1.1]
    print(f"\n{len(rows)} configurations, {len(bad)} outside [0.9, 1.1]; ratios "
          f"{min(r['ratio'] for r in rows):.3f}-{max(r['ratio'] for r in rows):.3f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Predicted vs real model-state bytes per rank: zerotune.plan.model_states against the DeepSpeed engine.

Runs the real CLI (one Hydra -m sweep per group of configurations, 1 step, synthetic data) for
models x ZeRO stages x offload x world sizes, reads what `partition_bytes` measured on every rank after
step 1 (`ranks/rank<k>.json`), and prints, per configuration and key, the predicted bytes, the engine's and
the difference. Stage 0 with offload=cpu is refused by preflight (offload needs a partitioned optimizer):
those rows say so.

    python benchmarks/bench_plan_model_states.py [--models tiny,sdxl_tiny] [--stages 0,1,2,3]
        [--offloads none,cpu] [--worlds 1,2] [--out /tmp/plan_states] [--tree /path/to/checkout]
        [--extra precision=bf16 optimizer=lion ...]

`--tree`: run the training side from another checkout of zerotune (e.g. `git archive HEAD` unpacked), its
`src` first on PYTHONPATH: for when the working tree's CLI is mid-edit. The prediction is this tree's.

About 25-60 s per configuration on 2 CPU cores (mostly worker start-up); the full grid takes ~20 min.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from itertools import product
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("params_bytes", "grads_bytes", "master_weights_bytes", "optimizer_state_bytes")
QUICK = ("data=synthetic", "resolution=16", "train.batch_size=2", "train.max_steps=1", "train.log_every=1",
         "evaluate.enabled=false", "scheduler=constant")
EXTRA: list[str] = []  # --extra: more overrides for both sides (precision=bf16, optimizer=lion, ...)


def _env(tree: Path) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    if tree.resolve() != ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), str(tree), env.get("PYTHONPATH", "")])
    return {**env, "PYTHONUNBUFFERED": "1"}


def _overrides(job: Path) -> dict:
    """A job's overrides as Hydra recorded them (sweep values come back quoted: zero_stage='1')."""
    pairs = (o.split("=", 1) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()))
    return {k: v.strip("'\"") for k, v in pairs}


def run_sweep(models, stages, offloads, worlds, sweep_dir: Path, tree: Path = ROOT, timeout: int = 3600) -> dict:
    """One `train.py -m` over the cartesian product; {(model, stage, offload, world): [partition per rank]}."""
    args = [sys.executable, str(tree / "train.py"), "-m", f"model={','.join(models)}",
            f"zero_stage={','.join(map(str, stages))}", f"offload={','.join(offloads)}",
            f"launch.num_processes={','.join(map(str, worlds))}", *QUICK, *EXTRA, f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(args, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    found = {}
    for job in sorted(p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").exists()):
        over = _overrides(job)
        key = (over["model"], int(over["zero_stage"]), over["offload"], int(over["launch.num_processes"]))
        ranks = sorted((job / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        found[key] = [json.loads(p.read_text())["partition"] for p in ranks] or None
    missing = [k for k in product(models, stages, offloads, worlds) if not found.get(k)]
    if missing:
        raise RuntimeError(f"no engine figures for {missing}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return found


def engine_partitions(combos, out: Path, tree: Path = ROOT) -> dict:
    """Engine figures for (model, stage, offload, world) combos, grouped into as few sweeps as possible."""
    combos = [c for c in combos if not refused(*c)]
    groups: dict = {}
    for model, stage, offload, world in combos:  # stage 0 only takes offload=none: its own sweep
        groups.setdefault((stage == 0,), set()).add((model, stage, offload, world))
    found = {}
    for i, members in enumerate(groups.values()):
        axes = [sorted({m[j] for m in members}) for j in range(4)]
        found.update(run_sweep(*axes, Path(tempfile.mkdtemp(prefix=f"sweep{i}-", dir=out)), tree))
    return {c: found[c] for c in combos}


def refused(model: str, stage: int, offload: str, world: int) -> bool:
    return stage == 0 and offload != "none"


def predicted(model: str, stage: int, offload: str, world: int) -> list[dict]:
    """What the planner predicts for every rank of that job, from a meta-device build and preflight's dict."""
    from tests.helpers.cli import compose_cfg
    from zerotune.plan.model_states import model_state_bytes, param_numels
    from zerotune.preflight import preflight

    cfg = compose_cfg(f"model={model}", f"zero_stage={stage}", f"offload={offload}",
                      f"launch.num_processes={world}", *QUICK, *EXTRA)
    checked = preflight(cfg, world_size=world)
    numels = param_numels(cfg.model)
    return [model_state_bytes(numels, checked.ds_config, world, r, checked.use_deepspeed) for r in range(world)]


def compare(combo, engine: list[dict]) -> list[dict]:
    """Rows of (rank, key, predicted, engine, difference) for one configuration."""
    rows = []
    for rank, (pred, real) in enumerate(zip(predicted(*combo), engine, strict=True)):
        for key in KEYS:
            rows.append({"combo": combo, "rank": rank, "key": key, "predicted": pred[key], "engine": real[key],
                         "diff": pred[key] - real[key]})
    return rows


def table(combos, engine: dict) -> list[str]:
    head = f"{'model':<10}{'stage':>6}{'offload':>8}{'world':>6}{'rank':>5}  " + "".join(
        f"{k.replace('_bytes', ''):>34}" for k in KEYS)
    lines = [head, " " * 37 + "".join(f"{'predicted / engine (diff)':>34}" for _ in KEYS)]
    for combo in combos:
        if refused(*combo):
            lines.append(f"{combo[0]:<10}{combo[1]:>6}{combo[2]:>8}{combo[3]:>6}    -  refused by preflight: "
                         "offload needs ZeRO stage 1 or more")
            continue
        rows = compare(combo, engine[combo])
        for rank in range(combo[3]):
            cells = [r for r in rows if r["rank"] == rank]
            lines.append(f"{combo[0]:<10}{combo[1]:>6}{combo[2]:>8}{combo[3]:>6}{rank:>5}  " + "".join(
                f"{c['predicted']:>13,} / {c['engine']:>11,} ({c['diff']:+d})" for c in cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,sdxl_tiny")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--offloads", default="none,cpu")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--out", default=None, help="folder for the sweeps' run directories (default: a temp dir)")
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose train.py runs the engine side")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every job, e.g. precision=bf16")
    a = ap.parse_args(argv)
    EXTRA[:] = a.extra
    combos = list(product(a.models.split(","), map(int, a.stages.split(",")), a.offloads.split(","),
                          map(int, a.worlds.split(","))))
    out = Path(a.out or tempfile.mkdtemp(prefix="plan_states-"))
    out.mkdir(parents=True, exist_ok=True)
    engine = engine_partitions(combos, out, Path(a.tree))
    lines = table(combos, engine)
    print("\n".join(lines))
    diffs = [r["diff"] for c in combos if not refused(*c) for r in compare(c, engine[c])]
    print(f"\n{len(combos)} configurations ({sum(refused(*c) for c in combos)} refused), {len(diffs)} figures, "
          f"{sum(d != 0 for d in diffs)} differ; largest |difference| {max(map(abs, diffs), default=0)} bytes")
    return 0 if not any(diffs) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

"""Predicted vs real model-state bytes per rank: zerotune.plan.model_states against the DeepSpeed engine.

Runs the real CLI (one Hydra -m sweep per group of configurations, 1 step, synthetic data) for
models x ZeRO stages x offload x world sizes x adapters (none: full training; lora: the base U-Net frozen,
the adapter trained), reads what `partition_bytes` measured on every rank after
step 1 (`ranks/rank<k>.json`), and prints, per configuration and key, the predicted bytes, the engine's and
the difference. Stage 0 with offload=cpu is refused by preflight (offload needs a partitioned optimizer):
those rows say so.

    python benchmarks/bench_plan_model_states.py [--models tiny,sdxl_tiny] [--stages 0,1,2,3]
        [--offloads none,cpu] [--worlds 1,2] [--adapters none,lora] [--out /tmp/plan_states]
        [--tree /path/to/checkout]
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


def run_sweep(models, stages, offloads, worlds, adapters, sweep_dir: Path, tree: Path = ROOT,
              timeout: int = 3600) -> dict:
    """One `train.py -m` over the cartesian product; {(model, stage, offload, world, adapter): [partition
    per rank]}."""
    args = [sys.executable, str(tree / "train.py"), "-m", f"model={','.join(models)}",
            f"zero_stage={','.join(map(str, stages))}", f"offload={','.join(offloads)}",
            f"launch.num_processes={','.join(map(str, worlds))}", f"adapter={','.join(adapters)}", *QUICK, *EXTRA,
            f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(args, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    found = {}
    for job in sorted(p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").exists()):
        over = _overrides(job)
        key = (over["model"], int(over["zero_stage"]), over["offload"], int(over["launch.num_processes"]),
               over["adapter"])
        ranks = sorted((job / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        found[key] = [json.loads(p.read_text())["partition"] for p in ranks] or None
    missing = [k for k in product(models, stages, offloads, worlds, adapters) if not found.get(k)]
    if missing:
        raise RuntimeError(f"no engine figures for {missing}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return found


def combo(model: str, stage: int, offload: str, world: int, adapter: str = "none") -> tuple:
    """(model, stage, offload, world, adapter): a configuration of the grid (adapter none by default)."""
    return model, int(stage), offload, int(world), adapter


def engine_partitions(combos, out: Path, tree: Path = ROOT) -> dict:
    """Engine figures for (model, stage, offload, world[, adapter]) combos, grouped into as few sweeps as
    possible; keyed by the combos as given."""
    combos = [c for c in combos if not refused(*c)]
    groups: dict = {}
    for c in combos:  # stage 0 only takes offload=none: its own sweep
        groups.setdefault((c[1] == 0,), set()).add(combo(*c))
    found = {}
    for i, members in enumerate(groups.values()):
        axes = [sorted({m[j] for m in members}) for j in range(5)]
        found.update(run_sweep(*axes, Path(tempfile.mkdtemp(prefix=f"sweep{i}-", dir=out)), tree))
    return {c: found[combo(*c)] for c in combos}


def refused(model: str, stage: int, offload: str, world: int, adapter: str = "none") -> bool:
    return stage == 0 and offload != "none"


def predicted(model: str, stage: int, offload: str, world: int, adapter: str = "none") -> list[dict]:
    """What the planner predicts for every rank of that job, from a meta-device build (with the adapter)
    and preflight's dict."""
    from tests.helpers.cli import compose_cfg
    from zerotune.config.compose.settle import settle
    from zerotune.plan.model_states import Partitioning, param_numels
    from zerotune.plan.resolve import check

    cfg = compose_cfg(f"model={model}", f"zero_stage={stage}", f"offload={offload}",
                      f"launch.num_processes={world}", f"adapter={adapter}", *QUICK, *EXTRA)
    resolved = check(settle(cfg, world_size=world))
    numels, trainable = param_numels(resolved.config.model, resolved.config.adapter)
    part = Partitioning(numels, resolved.ds_config, world, resolved.use_deepspeed, trainable, resolved.group_sizes(),
                        resolved.client_optimizer, resolved.model_stats.trained_shapes())
    return [part.states for _ in range(world)]  # every rank's partition is padded to one size


def compare(combo, engine: list[dict]) -> list[dict]:
    """Rows of (rank, key, predicted, engine, difference) for one configuration."""
    rows = []
    for rank, (pred, real) in enumerate(zip(predicted(*combo), engine, strict=True)):
        for key in KEYS:
            rows.append({"combo": combo, "rank": rank, "key": key, "predicted": pred[key], "engine": real[key],
                         "diff": pred[key] - real[key]})
    return rows


def _label(c: tuple) -> str:
    model, stage, offload, world, adapter = combo(*c)
    return f"{model:<10}{stage:>6}{offload:>8}{world:>6}{adapter:>8}"


def table(combos, engine: dict) -> list[str]:
    head = f"{'model':<10}{'stage':>6}{'offload':>8}{'world':>6}{'adapter':>8}{'rank':>5}  " + "".join(
        f"{k.replace('_bytes', ''):>34}" for k in KEYS)
    lines = [head, " " * 45 + "".join(f"{'predicted / engine (diff)':>34}" for _ in KEYS)]
    for c in combos:
        if refused(*c):
            lines.append(f"{_label(c)}    -  refused by preflight: offload needs ZeRO stage 1 or more")
            continue
        rows = compare(c, engine[c])
        for rank in range(c[3]):
            cells = [r for r in rows if r["rank"] == rank]
            lines.append(f"{_label(c)}{rank:>5}  " + "".join(
                f"{x['predicted']:>13,} / {x['engine']:>11,} ({x['diff']:+d})" for x in cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,sdxl_tiny")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--offloads", default="none,cpu")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--adapters", default="none", help="none (full training), lora, or both: none,lora")
    ap.add_argument("--out", default=None, help="folder for the sweeps' run directories (default: a temp dir)")
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose train.py runs the engine side")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every job, e.g. precision=bf16")
    a = ap.parse_args(argv)
    EXTRA[:] = a.extra
    combos = list(product(a.models.split(","), map(int, a.stages.split(",")), a.offloads.split(","),
                          map(int, a.worlds.split(",")), a.adapters.split(",")))
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

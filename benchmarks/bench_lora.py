"""Full training vs adapter=lora: trainable parameters, checkpoint size on disk, exported weights, step time.

For model=tiny (data=digits, 8 px, batch 64: the default job's recipe) and model=sdxl_tiny (data=synthetic,
128 px = 32x32 latents, batch 8), each trained twice here, once fully and once with adapter=lora (peft, rank 16,
on the model's lora_targets), for --steps steps from random weights (values do not change sizes or speed),
with a checkpoint at the last step, under the default ZeRO-2, fp32, one process. Per run it reads
summary.json (trainable_params, perf.step_time_median_s: the median over the steps after the first 5) and
measures the saved checkpoint folder (bytes of every file, and its model-states and optimizer-states files),
then exports the checkpoint (python -m zerotune export) and measures what a user ships: unet.safetensors for
full training, lora/pytorch_lora_weights.safetensors for LoRA. With --repeats N the runs alternate
(full, lora, full, lora, ...) so that load from other processes hits both alike; the step time is the median
of the runs' medians (the lowest is printed too: on a shared machine, the run least slowed by other
processes; each run records the 1-minute load average before and after it), the sizes are the first run's
(they do not vary). Last, SDXL's U-Net (model=sdxl) at
adapter.rank=16: parameter counts from the architecture on the meta device (no weights, no memory).

    python benchmarks/bench_lora.py [--steps 40] [--repeats 1] [--out /tmp/bench_lora] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPS = {
    "tiny": ["model=tiny", "data=digits"],
    "sdxl_tiny": ["model=sdxl_tiny", "data=synthetic", "resolution=128", "train.batch_size=8"],
}
ADAPTERS = {"full": ["adapter=none"], "lora": ["adapter=lora", "adapter.rank=16"]}


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(run_dir: Path, setup: str, adapter: str, steps: int) -> dict:
    """One training run and its export; the figures of both."""
    shutil.rmtree(run_dir, ignore_errors=True)
    load_before = os.getloadavg()[0]
    run([sys.executable, str(ROOT / "train.py"), *SETUPS[setup], *ADAPTERS[adapter], f"train.max_steps={steps}",
         f"checkpoint.every_n_steps={steps}", "evaluate.enabled=false", "train.log_every=1",
         f"hydra.run.dir={run_dir}"])
    load_after = os.getloadavg()[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary["status"] != "ok":
        raise SystemExit(f"{run_dir}: {summary['status']} {summary.get('error')}")
    ckpt = Path(summary["checkpoint"]["last_complete"])
    files = {f.name: f.stat().st_size for f in (ckpt / "pytorch_model").iterdir()}
    run([sys.executable, "-m", "zerotune", "export", str(ckpt), str(run_dir / "export")])
    shipped = run_dir / "export" / ("unet.safetensors" if adapter == "full" else "lora/pytorch_lora_weights.safetensors")
    return {"setup": setup, "adapter": adapter, "num_params": summary["num_params"],
            "trainable_params": summary["trainable_params"], "step_time_median_s": summary["perf"]["step_time_median_s"],
            "checkpoint_bytes": folder_bytes(ckpt),
            "model_states_bytes": sum(v for k, v in files.items() if "model_states" in k),
            "optim_states_bytes": sum(v for k, v in files.items() if "optim_states" in k),
            "export_bytes": shipped.stat().st_size, "export_file": str(shipped.relative_to(run_dir)),
            "loadavg_1min": [round(load_before, 2), round(load_after, 2)]}


def merged(runs: list[dict]) -> dict:
    first = dict(runs[0])
    first["step_times_s"] = [r["step_time_median_s"] for r in runs]
    first["step_time_median_s"] = statistics.median(first["step_times_s"])
    first["step_time_least_disturbed_s"] = min(first["step_times_s"])
    return first


def sdxl_counts(rank: int) -> dict:
    from zerotune.config.compose import compose
    from zerotune.models import model_stats

    full = model_stats(compose(["model=sdxl", "data=synthetic"]).model)
    cfg = compose(["model=sdxl", "data=synthetic", "adapter=lora", f"adapter.rank={rank}"])
    lora = model_stats(cfg.model, cfg.adapter)
    return {"rank": rank, "targets": list(cfg.adapter.target_modules), "base_params": full.num_params,
            "lora_trainable": lora.num_trainable, "lora_total": lora.num_params}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.4f}"


def table(rows: dict[str, dict[str, dict]]) -> str:
    keys = [("trainable_params", "trainable params"), ("checkpoint_bytes", "checkpoint folder (bytes)"),
            ("model_states_bytes", "  model states (bytes)"), ("optim_states_bytes", "  optimizer states (bytes)"),
            ("export_bytes", "exported weights (bytes)"), ("step_time_median_s", "median step time (s)"),
            ("step_time_least_disturbed_s", "  lowest run median (s)")]
    lines = ["| model | figure | full | lora | lora / full |", "|---|---|---|---|---|"]
    for setup, pair in rows.items():
        full, lora = pair["full"], pair["lora"]
        for key, label in keys:
            fmt = (lambda v: f"{v:.4f}") if key.startswith("step_time") else (lambda v: f"{v:,}")
            lines.append(f"| {setup} | {label} | {fmt(full[key])} | {fmt(lora[key])} | {ratio(lora[key], full[key])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="/tmp/bench_lora")
    parser.add_argument("--json", default=None, help="also write every figure here")
    args = parser.parse_args(argv)
    out, rows = Path(args.out), {}
    for setup in SETUPS:
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for i in range(args.repeats):
            for adapter in ADAPTERS:
                runs[adapter].append(measure(out / f"{setup}-{adapter}-{i}", setup, adapter, args.steps))
                print(f"{setup} {adapter} run {i}: {runs[adapter][-1]}", flush=True)
        rows[setup] = {a: merged(r) for a, r in runs.items()}
    print(f"\n{args.steps} steps per run, {args.repeats} run(s) per row; step time: median of the runs' medians "
          "(and the lowest of them: the run least slowed by other processes)\n")
    print(table(rows))
    sdxl = sdxl_counts(16)
    print(f"\nSDXL U-Net (model=sdxl), adapter=lora rank {sdxl['rank']} on {sdxl['targets']}: "
          f"{sdxl['lora_trainable']:,} trainable of {sdxl['lora_total']:,} (base {sdxl['base_params']:,}; "
          f"full training trains all {sdxl['base_params']:,}: lora / full = "
          f"{ratio(sdxl['lora_trainable'], sdxl['base_params'])})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "sdxl": sdxl, "steps": args.steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

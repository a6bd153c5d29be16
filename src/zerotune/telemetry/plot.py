"""Plot a run's metrics.jsonl: memory and step time against step."""

from __future__ import annotations

import json
import os

# Figure + the Agg canvas directly, not pyplot: no global backend switch, no display needed, thread-safe.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

STEP_TIME_KEY = "perf/step_time_s"
MEMORY_PREFIX = "memory/"


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for rows where `key` has a non-null value."""
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_run(metrics_jsonl_path: str | os.PathLike[str], out_png: str | os.PathLike[str]) -> str:
    """Writes a 2-panel PNG: every `memory/*` series with at least one value (host RSS, GPU when measured,
    NVMe...) and `perf/step_time_s`, both against `step`. Returns the PNG path."""
    with open(metrics_jsonl_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    memory_keys = sorted({k for r in rows for k, v in r.items() if k.startswith(MEMORY_PREFIX) and v is not None})

    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_mem, ax_time = fig.subplots(2, 1, sharex=True)

    for key in memory_keys:
        xs, ys = _series(rows, key)
        ax_mem.plot(xs, ys, marker=".", label=key.removeprefix(MEMORY_PREFIX))
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("memory")
    if memory_keys:
        ax_mem.legend(loc="best", fontsize="small")
    else:
        ax_mem.text(0.5, 0.5, "no memory metrics", ha="center", va="center", transform=ax_mem.transAxes)

    xs, ys = _series(rows, STEP_TIME_KEY)
    ax_time.plot(xs, ys, marker=".", color="tab:red")
    ax_time.set_ylabel("s")
    ax_time.set_title("step time")
    ax_time.set_xlabel("step")

    out = os.fspath(out_png)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100)
    return out

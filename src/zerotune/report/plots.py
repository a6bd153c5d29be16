"""The sweep as pictures (PNG, Agg): GPU memory and step time against resolution, host memory by stage. Unmeasured
values are left out, never drawn as 0; a wholly unmeasured quantity's PNG is still written, saying so."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Figure + the Agg canvas directly, not pyplot: no global backend switch, no display needed.
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from zerotune.report.collect import sort_key
from zerotune.rundir.summary import Status

if TYPE_CHECKING:
    from matplotlib.typing import LineStyleType

GPU_PNG = "gpu_memory_vs_resolution.png"
TIME_PNG = "step_time_vs_resolution.png"
HOST_PNG = "host_memory_by_stage.png"
# Statuses drawn as a red X : the configuration ran and did not finish.
# missing/running jobs are not drawn.
DID_NOT_FINISH = {Status.OOM: "OOM", Status.FAILED: str(Status.FAILED), Status.TIMEOUT: str(Status.TIMEOUT)}
# An OOM job's label by the memory that ran out (collect.oom_kind): the host's is told apart.
OOM_LABELS = {"host": "host OOM"}
OFFLOAD_STYLE: dict[str, LineStyleType] = {"none": "-", "cpu": "--", "nvme": ":"}
# Keys that are an axis or a facet; every other swept key splits lines further.
LAYOUT_KEYS = ("zero_stage", "offload", "resolution", "batch_size")
MAX_COLS = 3
LABEL_WIDTH = 38  # legend labels wrap here, so several swept keys don't make the legend wider than the plot


@dataclass(frozen=True)
class Plot:
    path: Path
    title: str
    note: str | None = None  # set when the quantity was not measured at all


def write_plots(rows: list[dict], keys: list[str], out_dir: Path) -> list[Plot]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_vs_resolution(rows, keys, "gpu_peak_process_mib", "peak GPU process memory (MiB)",
                           "GPU memory unmeasured (no GPU)", out_dir / GPU_PNG),
        plot_vs_resolution(rows, keys, "step_time_median_s", "median step time (s)",
                           "step time unmeasured", out_dir / TIME_PNG),
        plot_host_memory(rows, out_dir / HOST_PNG),
    ]


def plot_vs_resolution(rows: list[dict], keys: list[str], metric: str, ylabel: str, unmeasured: str,
                       path: Path) -> Plot:
    """One line per stage x offload (x other swept keys), one panel per batch size; red X = did not finish."""
    title = f"{ylabel} vs resolution"
    drawn = [r for r in rows if r["params"].get("resolution") is not None
             and (r["status"] in DID_NOT_FINISH or r["status"] == Status.OK)]
    if not any(r["status"] == Status.OK and r[metric] is not None for r in drawn):
        _message_png(path, unmeasured, title)
        return Plot(path, title, unmeasured)
    line_keys = ["zero_stage", "offload", *(k for k in keys if k not in LAYOUT_KEYS)]
    series = _ordered({_value_tuple(r, line_keys) for r in drawn})
    colors = {s: f"C{i % 10}" for i, s in enumerate(series)}
    batches = _ordered({r["params"].get("batch_size") for r in drawn})
    labels = {s: _series_label(s, line_keys) for s in series}
    fig, axes = _grid(len(batches), title, legend_lines=sum(lab.count("\n") + 1 for lab in labels.values()))
    for ax, batch in zip(axes, batches, strict=False):
        panel = [r for r in drawn if r["params"].get("batch_size") == batch]
        for i, s in enumerate(series):
            mine = [r for r in panel if _value_tuple(r, line_keys) == s]
            ok = sorted((r["params"]["resolution"], r[metric]) for r in mine
                        if r["status"] == Status.OK and r[metric] is not None)
            if ok:
                ax.plot(*zip(*ok, strict=True), marker="o", color=colors[s],
                        linestyle=OFFLOAD_STYLE.get(str(s[1]), "-."))
            # Spread the marks of different lines a little so two OOMs at one resolution both show.
            shift = 2 ** (0.06 * (i - (len(series) - 1) / 2))
            _mark_unfinished(ax, [(r["params"]["resolution"] * shift, unfinished_label(r)) for r in mine
                                  if r["status"] in DID_NOT_FINISH], colors[s])
        _resolution_axis(ax, [r["params"]["resolution"] for r in panel])
        ax.set_title(f"batch size {batch}")
        ax.set_ylabel(ylabel)
        top = max((r[metric] for r in panel if r["status"] == Status.OK and r[metric] is not None), default=1.0)
        ax.set_ylim(0, top * 1.3)  # headroom keeps the top-edge X marks clear of the lines
    handles = [Line2D([], [], color=colors[s], linestyle=OFFLOAD_STYLE.get(str(s[1]), "-."), marker="o",
                      label=labels[s]) for s in series]
    handles.append(Line2D([], [], color="red", marker="X", linestyle="", label="did not finish (top edge)"))
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    _save(fig, path)
    return Plot(path, title)


def plot_host_memory(rows: list[dict], path: Path) -> Plot:
    """Grouped bars: ZeRO stage groups, one bar per offload, one panel per resolution x batch size."""
    metric, title = "host_peak_rss_mib", "peak host memory (MiB) by ZeRO stage and offload"
    drawn = [r for r in rows if r["params"].get("zero_stage") is not None
             and (r["status"] in DID_NOT_FINISH or r["status"] == Status.OK)]
    if not any(r["status"] == Status.OK and r[metric] is not None for r in drawn):
        _message_png(path, "host memory unmeasured", title)
        return Plot(path, title, "host memory unmeasured")
    stages = _ordered({r["params"]["zero_stage"] for r in drawn})
    offloads = _ordered({r["params"].get("offload") for r in drawn})
    panels = _ordered({(r["params"].get("resolution"), r["params"].get("batch_size")) for r in drawn})
    width = 0.8 / len(offloads)
    fig, axes = _grid(len(panels), title)
    aggregated = False
    for ax, (res, batch) in zip(axes, panels, strict=False):
        panel = [r for r in drawn
                 if (r["params"].get("resolution"), r["params"].get("batch_size")) == (res, batch)]
        for j, offload in enumerate(offloads):
            for x, stage in enumerate(stages):
                cell = [r for r in panel
                        if (r["params"]["zero_stage"], r["params"].get("offload")) == (stage, offload)]
                values = [r[metric] for r in cell if r["status"] == Status.OK and r[metric] is not None]
                pos = x - 0.4 + width * (j + 0.5)
                if values:
                    aggregated |= len(values) > 1
                    ax.bar(pos, max(values), width, color=f"C{j % 10}")
                else:
                    _mark_unfinished(ax, [(pos, unfinished_label(r)) for r in cell if r["status"] in DID_NOT_FINISH],
                                     "red", y=0.05)
        ax.set_xticks(range(len(stages)), [f"ZeRO-{s}" for s in stages])
        ax.set_title(f"resolution {res}, batch size {batch}")
        ax.set_ylabel("MiB")
    handles: list[Artist] = [Patch(color=f"C{j % 10}", label=f"offload {o}") for j, o in enumerate(offloads)]
    handles.append(Line2D([], [], color="red", marker="X", linestyle="", label="did not finish"))
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    if aggregated:
        fig.suptitle(f"{title}\n(bar = the largest of the jobs that share a panel and bar)")
    _save(fig, path)
    return Plot(path, title)


def unfinished_label(row: dict) -> str:
    """What a red X says: the status, and for an out-of-memory job which memory ran out, where known."""
    return OOM_LABELS.get(row.get("oom_kind") or "", DID_NOT_FINISH[row["status"]]) if row["status"] == Status.OOM \
        else DID_NOT_FINISH[row["status"]]


def _mark_unfinished(ax: Axes, points: list[tuple[float, str]], edge: str, y: float = 0.93) -> None:
    """A red X at height `y` (axes fraction) with its label written above it."""
    edge_of_axes = blended_transform_factory(ax.transData, ax.transAxes)
    for x, label in points:
        ax.scatter([x], [y], marker="X", s=90, color="red", edgecolors=edge, linewidths=1.2,
                   transform=edge_of_axes, zorder=5, clip_on=False)
        ax.text(x, y + 0.035, label, color="red", fontsize=7, ha="center", va="bottom",
                transform=edge_of_axes)


def _resolution_axis(ax: Axes, resolutions: list[float]) -> None:
    ticks = sorted(set(resolutions))
    ax.set_xscale("log", base=2)  # resolutions double from one option to the next
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 1.5, ticks[0] * 1.5)
    ax.set_xlabel("resolution (px)")


def _grid(n: int, title: str, legend_lines: int = 4) -> tuple[Figure, list[Axes]]:
    cols = min(MAX_COLS, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    # Tall enough for the legend beside the panels: a cramped one would squeeze the axes to nothing.
    height = max(3.4 * rows + 0.8, 0.2 * legend_lines + 1.0)
    fig = Figure(figsize=(4.2 * cols + 3.2, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes[:n]


def _message_png(path: Path, message: str, title: str) -> None:
    fig = Figure(figsize=(6, 3), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=14, transform=ax.transAxes)
    fig.suptitle(title)
    _save(fig, path)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=90)


def _value_tuple(row: dict, keys: list[str]) -> tuple:
    return tuple(_hashable(row["params"].get(k)) for k in keys)


def _hashable(value: Any) -> Any:
    """A list or dict value (a tune trial's `validation.prompts=[]`) by its text: a series is a set member."""
    return str(value) if isinstance(value, (list, dict)) else value


def _ordered(values: set) -> list:
    def order(v: Any) -> Any:
        return [sort_key(x) for x in v] if isinstance(v, tuple) else sort_key(v)
    return sorted(values, key=order)


def _series_label(values: tuple, keys: list[str]) -> str:
    stage, offload, *rest = values
    extra = "".join(f", {k}={v}" for k, v in zip(keys[2:], rest, strict=True))
    return textwrap.fill(f"ZeRO-{stage}, offload {offload}{extra}", LABEL_WIDTH, subsequent_indent="  ")

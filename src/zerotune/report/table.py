"""The sweep as tables: summary.csv for tools, Markdown for people. Unmeasured values are empty CSV cells and "n/a"
in Markdown, never 0."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerotune.report.collect import (
    PARAM_COUNT_KEYS,
    PLAN_ERROR,
    RATIOS,
    has_plan,
    not_comparable,
    numbers_first,
    shown_ratio,
    sort_key,
    status_counts,
)

Column = tuple[str, str, Callable[[Any], str]]
MIB, RATIO = "{:.0f}".format, "{:.2f}".format
# (row key, Markdown header, Markdown format) for the measured columns, in table order.
METRIC_COLUMNS: list[Column] = [
    ("status", "status", str),
    ("gpu_peak_process_mib", "GPU peak MiB", MIB),
    ("gpu_peak_allocated_mib", "alloc MiB", MIB),
    ("gpu_peak_reserved_mib", "reserved MiB", MIB),
    ("host_peak_rss_mib", "host MiB", MIB),
    ("nvme_peak_mib", "NVMe MiB", MIB),
    ("step_time_median_s", "s/step (median)", "{:.3g}".format),
    ("samples_per_s", "samples/s", "{:.3g}".format),
    ("startup_s", "startup s", "{:.1f}".format),
    ("loss_last", "final loss", "{:.4f}".format),
    ("error", "error", str),  # blank, not n/a, when there was no error
]


def _count(n: int) -> str:
    """2.57B, 23.2M, 512: parameter counts at a glance (summary.csv keeps the exact figure)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


# Parameter counts, beside the configuration columns (only when some job recorded them: older sweeps keep
# their table). With an adapter, trainable = the adapter's, frozen = the base U-Net's.
COUNT_COLUMNS: list[Column] = [("trainable_params", "trainable params", _count),
                               ("frozen_params", "frozen params", _count)]
# The SLURM job each ran as (array jobs as <array>_<task>), when some job ran under SLURM.
SLURM_COLUMNS: list[Column] = [("slurm_job", "SLURM job", str)]
# The planner's columns, each placed after the measured column it predicts (only when some job has a plan).
PLAN_COLUMNS: dict[str, list[Column]] = {
    "gpu_peak_process_mib": [("plan_gpu_peak_mib", "pred. GPU MiB", MIB),
                             ("gpu_peak_measured_over_predicted", "GPU meas/pred", RATIO)],
    "host_peak_rss_mib": [("plan_host_peak_mib", "pred. host MiB", MIB),
                          ("host_peak_measured_over_predicted", "host meas/pred", RATIO)],
    "nvme_peak_mib": [("plan_nvme_mib", "pred. NVMe MiB", MIB)],
    "step_time_median_s": [("plan_time_floor_s", "floor s/step", "{:.3g}".format),
                           ("step_time_over_floor", "s/step / floor", RATIO)],
    "error": [(PLAN_ERROR, "planner error", str)],
}
NA = "n/a"
NOT_COMPARABLE = "-"
NA_NOTE = ("n/a: not measured (GPU figures are null where no GPU was present) or the job did not get "
           "that far. GPU peak = the process's peak as the driver saw it; alloc/reserved = PyTorch "
           "allocator peaks.")
PLAN_NOTE = ("pred. = the planner's prediction made before launch (n/a: no plan, or the planner failed); "
             "meas/pred = measured / predicted peak; floor s/step = the planner's lower bound on seconds per "
             "step, so s/step / floor is at least 1 when the plan is right. Ratios are n/a where either side "
             "is. Jobs with status planned were not run: they have predictions only. host meas/pred is printed only "
             "where the plan's host figure predicts the processes' RSS (a CPU run's process-RSS prediction: "
             "interpreter and imports, model, device terms); \"-\" where it is a GPU plan's host terms (pinned "
             "buffers, offloaded states), which leave out most of what the processes hold, so a ratio of the "
             "two would mean nothing.")
RATIO_KEYS = {name: (measured, predicted) for name, measured, predicted in RATIOS}


def metric_columns(rows: list[dict]) -> list[Column]:
    """The parameter counts (when any row has them), then METRIC_COLUMNS, with the planner's columns beside them
    when any row carries a plan (an older sweep gets no block of empty columns)."""
    counts = COUNT_COLUMNS if any(row.get(k) is not None for row in rows for k in PARAM_COUNT_KEYS) else []
    counts = [*SLURM_COLUMNS, *counts] if any(row.get("slurm_job") for row in rows) else counts
    if not has_plan(rows):
        return [*counts, *METRIC_COLUMNS]
    return [*counts, *(col for column in METRIC_COLUMNS for col in (column, *PLAN_COLUMNS.get(column[0], [])))]


def value(row: dict, key: str) -> Any:
    """The row's value for a metric column; a ratio column is computed from its two sides."""
    if key in RATIO_KEYS:
        computed = shown_ratio(row, key, *RATIO_KEYS[key])
        return None if computed is None else round(computed, 4)  # 1.0435, not 1.0434782608695652
    return row.get(key)


def sort_rows(rows: list[dict], keys: list[str]) -> list[dict]:
    """By the swept keys, then sweep and job number, so equal configurations from two sweeps sit together."""
    def order(row: dict) -> tuple:
        return [sort_key(row["params"].get(k)) for k in keys], row["sweep_dir"], numbers_first(row["job"])
    return sorted(rows, key=order)


def write_csv(rows: list[dict], keys: list[str], path: Path) -> Path:
    columns = ["sweep_dir", "job", *keys, *(key for key, _, _ in metric_columns(rows))]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in sort_rows(rows, keys):
            values = [row["params"].get(c) if c in keys else value(row, c) for c in columns]
            writer.writerow(["" if v is None else v for v in values])
    return path


def table_cells(rows: list[dict], keys: list[str]) -> tuple[list[str], list[list[str]]]:
    """The table's headers and cells as text, formatted as the Markdown table shows them."""
    several = len({r["sweep_dir"] for r in rows}) > 1
    columns = metric_columns(rows)
    headers = [*(["sweep"] if several else []), "job", *keys, *(h for _, h, _ in columns)]
    body = []
    for row in sort_rows(rows, keys):
        cells = [*([_sweep_label(row["sweep_dir"])] if several else []), row["job"]]
        cells += [_cell(row["params"].get(k), str) for k in keys]
        cells += [row.get(key) or "" if key in ("error", PLAN_ERROR)
                  else NOT_COMPARABLE if key in RATIO_KEYS and not_comparable(row, key) else _cell(value(row, key), fmt)
                  for key, _, fmt in columns]
        body.append(cells)
    return headers, body


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    headers, body = table_cells(rows, keys)
    return "\n".join([_md_row(headers), _md_row(["---"] * len(headers)), *(_md_row(cells) for cells in body)])


def reference_section(rows: list[dict]) -> str:
    """Measured vs reference for reproductions of published figures; empty when no row carries one."""
    refs = [r for r in rows if isinstance(r.get("experiment"), dict) and r["experiment"].get("reference")]
    if not refs:
        return ""
    headers = ["experiment", "job", "status", "GPU peak MiB", "reference MiB", "measured / reference",
               "s/step measured", "s/step reference", "reference source"]
    lines = ["## Measured vs reference", "", _md_row(headers), _md_row(["---"] * len(headers))]
    for row in refs:
        ref = row["experiment"]["reference"]
        measured, expected = row.get("gpu_peak_process_mib"), ref.get("gpu_peak_process_mib")
        ratio = ("unmeasured" if measured is None else NA if not expected else f"{measured / expected:.2f}×")
        lines.append(_md_row([
            str(row["experiment"].get("name", NA)), row["job"], row["status"],
            _cell(measured, "{:.0f}".format), _cell(expected, "{:.0f}".format), ratio,
            _timed(row.get("step_time_median_s"), row.get("device")),
            _timed(ref.get("step_time_s"), ref.get("device")), str(ref.get("source") or NA),
        ]))
    lines += ["", "Memory ratio = measured / reference peak GPU process memory. Step times were taken on "
              "the devices named and are shown side by side, not divided: times from different GPUs don't "
              "compare."]
    return "\n".join(lines)


def summary_markdown(rows: list[dict], keys: list[str], sections: list[str]) -> str:
    """The whole summary.md: header, the table, the reference comparison, then `sections` as given."""
    sweeps = ", ".join(f"`{s}`" for s in dict.fromkeys(r["sweep_dir"] for r in rows))
    parts = ["# zerotune sweep report", "", f"Sweeps: {sweeps}. {len(rows)} job(s): {status_counts(rows)}.",
             f"Configuration columns: {', '.join(keys) or 'none'} (the keys that differ across jobs; for "
             "jobs that all agree, the keys that name the configuration).", "",
             markdown_table(rows, keys), "", NA_NOTE + (" " + PLAN_NOTE if has_plan(rows) else "")]
    for section in (reference_section(rows), *sections):
        if section:
            parts += ["", section]
    return "\n".join(parts) + "\n"


def _cell(value: Any, fmt: Callable[[Any], str]) -> str:
    return NA if value is None else fmt(value)


def _timed(seconds: float | None, device: str | None) -> str:
    return NA if seconds is None else f"{seconds:.3g} s ({device or 'device unknown'})"


def _sweep_label(sweep_dir: str) -> str:
    """The last two path parts (`<date>/<time>`): enough to tell Hydra's sweeps apart."""
    path = Path(sweep_dir)
    return "/".join([p for p in path.parts if p != path.anchor][-2:]) or str(path)


def _md_row(cells: list[str]) -> str:
    # A pipe or newline inside a cell would break the table.
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

"""The sweep as tables: summary.csv for tools, Markdown for people.

Unmeasured values (None) are empty cells in the CSV, the usual "missing" for CSV readers, and "n/a" in
Markdown; neither is ever written as 0.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerotune.report.collect import sort_key

# (row key, Markdown header, Markdown format) for the measured columns, in table order.
METRIC_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("status", "status", str),
    ("gpu_peak_process_mib", "GPU peak MiB", "{:.0f}".format),
    ("gpu_peak_allocated_mib", "alloc MiB", "{:.0f}".format),
    ("gpu_peak_reserved_mib", "reserved MiB", "{:.0f}".format),
    ("host_peak_rss_mib", "host MiB", "{:.0f}".format),
    ("nvme_peak_mib", "NVMe MiB", "{:.0f}".format),
    ("step_time_median_s", "s/step (median)", "{:.3g}".format),
    ("samples_per_s", "samples/s", "{:.3g}".format),
    ("startup_s", "startup s", "{:.1f}".format),
    ("loss_last", "final loss", "{:.4f}".format),
    ("error", "error", str),  # blank, not n/a, when there was no error
]
NA = "n/a"
NA_NOTE = ("n/a: not measured (GPU figures are null where no GPU was present) or the job did not get "
           "that far. GPU peak = the process's peak as the driver saw it; alloc/reserved = PyTorch "
           "allocator peaks.")


def sort_rows(rows: list[dict], keys: list[str]) -> list[dict]:
    """By the swept keys, then sweep and job number, so equal configurations from two sweeps sit together."""
    def order(row: dict) -> tuple:
        job = row["job"]
        return ([sort_key(row["params"].get(k)) for k in keys], row["sweep_dir"],
                (0, int(job), "") if job.isdigit() else (1, 0, job))
    return sorted(rows, key=order)


def csv_columns(keys: list[str]) -> list[str]:
    return ["sweep_dir", "job", *keys, *(key for key, _, _ in METRIC_COLUMNS)]


def write_csv(rows: list[dict], keys: list[str], path: Path) -> Path:
    columns = csv_columns(keys)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in sort_rows(rows, keys):
            values = [row["params"].get(c) if c in keys else row.get(c) for c in columns]
            writer.writerow(["" if v is None else v for v in values])
    return path


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    several = len({r["sweep_dir"] for r in rows}) > 1
    headers = [*(["sweep"] if several else []), "job", *keys, *(h for _, h, _ in METRIC_COLUMNS)]
    lines = [_md_row(headers), _md_row(["---"] * len(headers))]
    for row in sort_rows(rows, keys):
        cells = [*([_sweep_label(row["sweep_dir"])] if several else []), row["job"]]
        cells += [_cell(row["params"].get(k), str) for k in keys]
        cells += [row.get(key) or "" if key == "error" else _cell(row.get(key), fmt)
                  for key, _, fmt in METRIC_COLUMNS]
        lines.append(_md_row(cells))
    return "\n".join(lines)


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
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r["status"] for r in rows).items()))
    parts = ["# zerotune sweep report", "", f"Sweeps: {sweeps}. {len(rows)} job(s): {counts}.",
             f"Configuration columns: {', '.join(keys) or 'none'} (the keys that differ across jobs; for "
             "jobs that all agree, the keys that name the configuration).", "",
             markdown_table(rows, keys), "", NA_NOTE]
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

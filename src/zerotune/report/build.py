"""One report, start to finish: collect the runs, then write summary.csv, summary.md and the plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.report.budget import BudgetAnswer, budget_answer
from zerotune.report.collect import RUNNING_WINDOW_S, collect_runs, swept_keys
from zerotune.report.plots import Plot, write_plots
from zerotune.report.table import markdown_table, summary_markdown, write_csv

CSV_NAME = "summary.csv"
MD_NAME = "summary.md"


@dataclass(frozen=True)
class Report:
    rows: list[dict]
    keys: list[str]          # the swept keys: the table's configuration columns
    csv_path: Path
    md_path: Path
    plots: list[Plot]
    table_md: str            # the Markdown table alone, for a terminal
    budget: BudgetAnswer | None


def build_report(dirs: Sequence[str | Path], out: str | Path | None = None, budget_mib: float | None = None,
                 metric: str = "gpu", where: dict[str, Any] | None = None,
                 running_window_s: float = RUNNING_WINDOW_S) -> Report:
    """Report on the sweep (or run) directories `dirs`, written into `out` (default: the first of them); with
    `budget_mib`, which configuration fits it fastest (among the jobs matching `where`). Raises
    FileNotFoundError / NoRunsError (from collect_runs) before writing anything."""
    rows = collect_runs(dirs, running_window_s)
    keys = swept_keys(rows)
    budget = budget_answer(rows, float(budget_mib), metric, where) if budget_mib is not None else None
    out_dir = Path(out) if out is not None else Path(dirs[0])
    plots = write_plots(rows, keys, out_dir)
    csv_path = write_csv(rows, keys, out_dir / CSV_NAME)
    md_path = out_dir / MD_NAME
    md_path.write_text(summary_markdown(rows, keys, [budget_section(budget), plots_section(plots)]))
    return Report(rows, keys, csv_path, md_path, plots, markdown_table(rows, keys), budget)


def budget_section(budget: BudgetAnswer | None) -> str:
    if budget is None:
        return ""
    return f"## Budget: {budget.budget_mib:.0f} MiB of {budget.metric}\n\n{budget.reason}"


def plots_section(plots: list[Plot]) -> str:
    lines = ["## Plots", ""]
    for plot in plots:
        note = f" -- {plot.note}: the PNG says so instead of plotting." if plot.note else ""
        lines.append(f"- `{plot.path.name}`: {plot.title}{note}")
    return "\n".join(lines)

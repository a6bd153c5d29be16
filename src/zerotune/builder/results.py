"""Results on the page: the sweeps under multirun/ and outputs/, and one sweep's report (the table with
measured and predicted figures side by side, the plots, the budget answer), built by zerotune.report."""

from __future__ import annotations

from pathlib import Path

from zerotune.builder.paths import RESULT_ROOTS, inside_results, project, shown
from zerotune.errors import ConfigError
from zerotune.report.build import build_report
from zerotune.report.collect import NoRunsError, find_sweeps, job_dirs
from zerotune.report.table import NA_NOTE, PLAN_NOTE, table_cells

SERVED = (".png", ".csv", ".md")  # what /api/file hands out from a results folder


def sweeps() -> list[dict]:
    """Newest first: every folder of jobs below multirun/ and outputs/ (two levels, as Hydra names them)."""
    found = []
    for root in RESULT_ROOTS:
        base = project() / root
        if base.is_dir():
            found += find_sweeps(base)
    return [{"folder": shown(s), "jobs": len(job_dirs(s))} for s in sorted(found, key=shown, reverse=True)]


def open_sweep(folder: str, budget_mib: float | None) -> dict:
    path = inside_results(folder)
    try:
        report = build_report([path], budget_mib=budget_mib)
    except (FileNotFoundError, NoRunsError) as exc:
        raise ConfigError("folder", str(exc), "pick a sweep from the list") from None
    headers, body = table_cells(report.rows, report.keys)
    return {"folder": shown(path), "headers": headers, "rows": body, "notes": f"{NA_NOTE} {PLAN_NOTE}",
            "budget": report.budget.reason if report.budget else None,
            "plots": [{"title": p.title, "file": shown(p.path), "note": p.note} for p in report.plots]}


def served_file(relative: str) -> Path:
    path = inside_results(relative, key="file")
    if path.suffix not in SERVED or not path.is_file():
        raise ConfigError("file", f"{relative!r} is not a report file", f"one of the sweep's {', '.join(SERVED)} files")
    return path

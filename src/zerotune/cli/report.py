"""`zerotune report <sweep dir>... [--budget-mib N] [--metric gpu|host] [--out DIR] [--where KEY=VALUE ...]`: the
command; the work is zerotune/report/."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from zerotune.report.collect import NoRunsError, parse_value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerotune report",
        description="Summarise zerotune sweeps: summary.csv, summary.md and plots, plus which configuration "
                    "fits a memory budget fastest.")
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                   help="a sweep directory (multirun/<date>/<time>) or a single run directory; several merge")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="memory budget in MiB: report the fastest ok configuration whose peak fits it "
                        "(measured peaks first; else the planner's predictions, marked as such)")
    p.add_argument("--metric", choices=["gpu", "host"], default="gpu",
                   help="which peak the budget applies to: GPU process memory (default) or host RSS")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="for the budget answer, only jobs with this value (repeatable), e.g. resolution=512: "
                        "step times only compare between jobs doing the same work")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the report (default: the first DIR)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for d in args.dirs:  # p.error exits 2, argparse's code for a usage error
        if not d.exists():
            p.error(f"argument DIR: {d} does not exist")
    if args.budget_mib is not None and not (math.isfinite(args.budget_mib) and args.budget_mib > 0):
        p.error(f"argument --budget-mib: must be a positive number of MiB, got {args.budget_mib}")
    where = {}
    for item in args.where:
        key, sep, value = item.partition("=")
        if not (sep and key):
            p.error(f"argument --where: expected KEY=VALUE, got {item!r}")
        where[key] = parse_value(value)
    if where and args.budget_mib is None:
        p.error("argument --where: narrows the budget answer, so it needs --budget-mib")
    from zerotune.report.build import build_report  # after the checks: a usage error needs no matplotlib

    try:
        report = build_report(args.dirs, out=args.out, budget_mib=args.budget_mib, metric=args.metric,
                              where=where)
    except NoRunsError as exc:
        p.error(f"argument DIR: {exc}")
    print(report.table_md)
    print()
    if report.budget is not None:
        print(f"Budget {report.budget.budget_mib:.0f} MiB ({report.budget.metric}): {report.budget.reason}")
    else:
        print("No budget given: pass --budget-mib N to name the fastest configuration that fits N MiB.")
    for plot in report.plots:
        if plot.note:
            print(f"{plot.path.name}: {plot.note}")
    print(f"Wrote {report.csv_path}, {report.md_path} and {len(report.plots)} plots.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

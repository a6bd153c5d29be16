"""The GPU kit's parts: each writes $OUT/<part>.json and $OUT/<part>.md, and stays inside its time budget.

    python benchmarks/gpu/kit.py PART [--dry-run] --out DIR --work DIR      (bash benchmarks/gpu/run.sh PART)

PART: env | reference | grid | paths | all. The JSON is rewritten after every row, so a part stopped from outside
still leaves what it measured. This process never touches CUDA: each measurement runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import parts  # noqa: E402
import report  # noqa: E402
import rows  # noqa: E402

# Seconds each part may take on the card: each fits one 10-minute device command with the install and the
# machine's own overhead to spare. ZEROTUNE_GPU_KIT_BUDGET_S overrides them all (a shorter rehearsal).
BUDGET_S = {"env": 240, "reference": 540, "grid": 540, "paths": 300}
# A grid row that has not finished in this long is stopped (it is recorded, with its log's tail).
ROW_CAP_S = {"reference": 300, "grid": 150}
PARTS = ("env", "reference", "grid", "paths")


class Part:
    """One part's record, written to OUT as JSON and Markdown after every change."""

    def __init__(self, name: str, out: Path, dry_run: bool, render):
        budget = float(os.environ.get("ZEROTUNE_GPU_KIT_BUDGET_S") or BUDGET_S[name])
        self.out, self.render, self.t0 = out, render, time.monotonic()
        self.record = {"part": name, "dry_run": dry_run, "started": datetime.now(UTC).isoformat(timespec="seconds"),
                       "host": socket.gethostname(), "budget_s": budget, "wall_s": 0.0, "complete": False,
                       "rows": []}

    def left(self) -> float:
        return self.record["budget_s"] - (time.monotonic() - self.t0)

    def save(self, complete: bool = False) -> None:
        self.record["wall_s"] = round(time.monotonic() - self.t0, 1)
        self.record["complete"] = complete
        name = self.record["part"]
        (self.out / f"{name}.json").write_text(json.dumps(self.record, indent=2, default=str) + "\n")
        (self.out / f"{name}.md").write_text(self.render(self.record))


def composes(overrides: list[str]) -> str | None:
    """None when zerotune composes these overrides, else the error's first line (a typo shows in a dry run)."""
    from zerotune.compose import compose
    from zerotune.errors import ConfigError

    try:
        compose(overrides)
    except ConfigError as exc:
        return str(exc).splitlines()[0]
    return None


def run_rows(name: str, table: list[rows.Row], out: Path, work: Path, dry_run: bool, kinds_run: set[str]) -> dict:
    """reference / grid: every row composed; rows run in order while the budget lasts (in a dry run, the first
    row of each kind: `kinds_run` is shared by the parts of one `all`)."""
    part = Part(name, out, dry_run, report.runs_markdown)
    chosen = [n for n in os.environ.get("ZEROTUNE_GPU_KIT_ROWS", "").split(",") if n]  # rows run alone
    for row in table:
        error = composes(rows.shrink(row.overrides, dry_run) + rows.COMMON)
        cap = min(part.left(), ROW_CAP_S[name])
        if chosen and row.name not in chosen:
            record = rows.skipped(row, "not run: not in ZEROTUNE_GPU_KIT_ROWS", dry_run)
        elif error:
            record = rows.skipped(row, f"config error: {error}", dry_run)
        elif dry_run and row.kind in kinds_run:
            record = rows.skipped(row, "not run: a dry run runs one row of each kind", dry_run)
        elif cap < 60:
            record = rows.skipped(row, "not run: the part's time budget is spent (ZEROTUNE_GPU_KIT_ROWS=<name> runs "
                                       "rows alone)", dry_run)
        else:
            kinds_run.add(row.kind)
            print(f"gpu kit: {name}/{row.name} (at most {cap:.0f} s)", flush=True)
            record = rows.run_row(row, work / name, dry_run, cap)
            print(f"gpu kit: {name}/{row.name}: {record['status']} in {record['wall_s']} s", flush=True)
        part.record["rows"].append(record)
        part.save()
    part.save(complete=True)
    return part.record


def run_env(out: Path, work: Path, dry_run: bool) -> dict:
    part = Part("env", out, dry_run, report.env_markdown)
    result = work / "env_probe.json"
    cmd = [sys.executable, str(Path(__file__).parent / "env_probe.py"), str(result), *(["--dry-run"] * dry_run)]
    part.record.update(command=" ".join(cmd[1:]), probe=None, error=None)
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=max(part.left(), 30))
        if proc.returncode == 0 and result.is_file():
            part.record["probe"] = json.loads(result.read_text())
        else:
            part.record["error"] = f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
    except subprocess.TimeoutExpired:
        part.record["error"] = "the probe outlasted the part's budget"
    part.save(complete=part.record["probe"] is not None)
    return part.record


def run_paths(out: Path, work: Path, dry_run: bool) -> dict:
    """pytest -m cuda over tests/test_cuda_paths.py; on a machine without CUDA every test is skipped."""
    part = Part("paths", out, dry_run, report.paths_markdown)
    junit = work / "paths-junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "tests/test_cuda_paths.py"]
    part.record.update(command=" ".join(cmd[1:]), exit_code=None)
    try:
        proc = subprocess.run(cmd, cwd=rows.ROOT, capture_output=True, text=True, timeout=max(part.left(), 30))
        part.record["exit_code"], part.record["log_tail"] = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        part.record["log_tail"] = f"stopped at the part's budget\n{exc.stdout or ''}"[-3000:]
    part.record["rows"] = junit_rows(junit) if junit.is_file() else []
    part.save(complete=part.record["exit_code"] is not None)
    return part.record


def junit_rows(path: Path) -> list[dict]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "")[:500]
        out.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                    "message": message})
    return out


def run_part(name: str, out: Path, work: Path, dry_run: bool, kinds_run: set[str]) -> dict:
    (work / name).mkdir(parents=True, exist_ok=True)
    if name == "env":
        return run_env(out, work / name, dry_run)
    if name == "paths":
        return run_paths(out, work / name, dry_run)
    return run_rows(name, parts.REFERENCE if name == "reference" else parts.GRID, out, work, dry_run, kinds_run)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=[*PARTS, "all"])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    kinds_run: set[str] = set()
    for name in PARTS if args.part == "all" else (args.part,):
        record = run_part(name, args.out.resolve(), args.work.resolve(), args.dry_run, kinds_run)
        print(f"gpu kit: {name}: {'complete' if record['complete'] else 'INCOMPLETE'} in {record['wall_s']} s "
              f"-> {args.out / (name + '.json')}, {args.out / (name + '.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The GPU kit's parts: each writes $OUT/<part>.json and $OUT/<part>.md, and stays inside its time budget.

    python benchmarks/gpu/kit.py PART [--dry-run] --out DIR --work DIR      (bash benchmarks/gpu/run.sh PART)

PART: first | loading | env | reference | grid | paths | all. A part plans before it starts: its pieces in order,
each with its estimated seconds on an H100 (estimates.py, from the recorded runs), against its budget counted from
the command's start (run.sh's install included, GPU_KIT_STARTED). It prints that plan, then starts a piece only
when its estimate fits what is left, and lists the others as not run, with their commands. `loading` plans within
its budget: the pieces whose estimates do not fit it, in order, are marked "past the budget" before it starts (the
plan's total leaves them out, and names the later call that runs them); each still runs if the pieces before it
ended soon enough that its estimate fits what is left. Both files are rewritten whole (by rename) before and after
every piece, so a call killed at its time limit still leaves valid files with every piece done so far. This process
never touches CUDA: each measurement runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).parent))

import estimates  # noqa: E402
import parts  # noqa: E402
import report  # noqa: E402
import rows  # noqa: E402

# One device call: at most 10 minutes a command, and the lease's 15 minutes include the machine's start. 8 minutes
# a call leave both room. ZEROTUNE_GPU_KIT_BUDGET_S overrides it (a shorter rehearsal, a longer call).
BUDGET_S = 480.0
# A piece still running at this many times its estimate is stuck or far off the records: it is stopped, and the
# pieces after it keep their time.
LIMIT_FACTOR = 2
PARTS = ("first", "loading", "env", "reference", "grid", "paths", "flux")
ALL = ("env", "reference", "grid", "paths")  # `all`: 8 files, what the device tool brings back; `first` repeats
# the env part and two reference rows, so `all` leaves it out, and `loading` is a call of its own
# A piece planned past its part's budget (`loading`): its estimate does not fit after those before it
PAST = "past the budget"


@dataclass
class Piece:
    """One step of a part's plan: a probe, a row, a test run."""

    name: str
    estimate_s: float                  # on an H100; the budget plans with it
    basis: str                         # how the estimate was reached
    command: str                       # what it runs: listed with the piece when it does not run
    run: Callable[[float], str]        # runs it, killed at the seconds given; its outcome in a few words
    not_run: Callable[[str], None]     # records it as not run, with why
    skip: str | None = None            # decided before the budget: not run, and why


class Part:
    """One part's record, written to OUT as JSON and Markdown before and after every piece."""

    def __init__(self, name: str, out: Path, dry_run: bool, render: Callable[[dict], str], started: float):
        """`started`: when the part's time began (epoch s): the command's start for a call's first part."""
        budget = float(os.environ.get("ZEROTUNE_GPU_KIT_BUDGET_S") or BUDGET_S)
        self.out, self.render, self.started = out, render, started
        self.record: dict = {"part": name, "dry_run": dry_run,
                             "started": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
                             "host": socket.gethostname(), "budget_s": budget, "wall_s": 0.0, "complete": False,
                             "estimates_from": estimates.RECORDS, "plan": [], "rows": []}

    def elapsed(self) -> float:
        return time.time() - self.started

    def left(self) -> float:
        return self.record["budget_s"] - self.elapsed()

    def save(self, complete: bool = False) -> None:
        self.record["wall_s"] = round(self.elapsed(), 1)
        self.record["complete"] = complete
        name = self.record["part"]
        write_whole(self.out / f"{name}.json", json.dumps(self.record, indent=2, default=str) + "\n")
        write_whole(self.out / f"{name}.md", self.render(self.record))


def write_whole(path: Path, text: str) -> None:
    """The new text or the old, never half of it: a call killed mid-write still leaves a file that parses."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def install_entry(part: Part, dry_run: bool, first_of_call: bool) -> dict:
    """The plan's first line: the seconds spent before the kit started (run.sh's install of the wheels), measured."""
    spent = round(max(part.elapsed(), 0.0), 1)
    basis = ("the call's earlier parts: not in this part's budget" if not first_of_call else
             "nothing installed: a dry run" if dry_run else
             "measured: run.sh before the kit (pip install of .whl/, skipped when this kit is installed already)")
    return {"piece": "install", "estimate_s": spent, "basis": basis, "command": "run.sh", "status": "done",
            "wall_s": spent}


def plan(part: Part, pieces: list[Piece], install: dict, within_budget: bool = False) -> dict:
    """The part's plan, in its record: the install, then each piece with its estimate and status, and the total.
    `within_budget`: the plan holds what fits the budget, in order; the rest is marked past it (cut_at_budget)."""
    part.record["plan"] = [install] + [
        {"piece": p.name, "estimate_s": round(p.estimate_s, 1), "basis": p.basis, "command": p.command,
         "status": p.skip or "planned", "wall_s": None} for p in pieces]
    if within_budget:
        cut_at_budget(part.record)
    part.record["plan_total_s"] = round(sum(e["estimate_s"] for e in part.record["plan"]
                                            if e["status"] in ("planned", "done")), 1)
    return part.record


def run_plan(part: Part, pieces: list[Piece], install: dict, within_budget: bool = False) -> dict:
    """Plans the pieces (printed, and saved with the part), then runs each whose estimate fits what is left."""
    plan(part, pieces, install, within_budget)
    print(report.plan_text(part.record), flush=True)
    part.save()
    for piece, entry in zip(pieces, part.record["plan"][1:], strict=True):
        left = part.left()
        if piece.skip:
            piece.not_run(piece.skip)
        elif piece.estimate_s > left:
            entry["status"] = (f"not run: needs about {piece.estimate_s:.0f} s, {max(left, 0):.0f} s of the "
                               "budget left")
            piece.not_run(entry["status"])
        else:
            limit = min(left, LIMIT_FACTOR * piece.estimate_s)
            entry["status"] = "running"
            part.save()
            print(f"gpu kit: {part.record['part']}/{piece.name} (about {piece.estimate_s:.0f} s, stopped at "
                  f"{limit:.0f} s)", flush=True)
            started = time.monotonic()
            outcome = piece.run(limit)
            entry.update(status="done", outcome=outcome, wall_s=round(time.monotonic() - started, 1))
            print(f"gpu kit: {part.record['part']}/{piece.name}: {outcome} in {entry['wall_s']} s", flush=True)
        part.save()
    if within_budget:
        part.record["later_call"] = later_call(part.record, lambda e: e["status"].startswith("not run: needs about"))
    part.save(complete=True)
    return part.record


def cut_at_budget(record: dict) -> None:
    """Marks each planned piece whose estimate, after the install and the planned pieces before it, is past the
    budget (a later one that fits stays planned, as a piece that fits what is left runs); records their seconds and
    the call that runs them."""
    spent = record["plan"][0]["estimate_s"]  # the install, measured
    for entry in record["plan"][1:]:
        if entry["status"] != "planned":
            continue
        if spent + entry["estimate_s"] > record["budget_s"]:
            entry["status"] = PAST
        else:
            spent += entry["estimate_s"]
    past = [e for e in record["plan"][1:] if e["status"] == PAST]
    record["past_budget_s"] = round(sum(e["estimate_s"] for e in past), 1)
    record["later_call"] = later_call(record, lambda e: e["status"] == PAST)


def later_call(record: dict, left: Callable[[dict], bool]) -> str | None:
    """The call that runs the pieces `left` picks (ZEROTUNE_GPU_KIT_ROWS), or None when there are none."""
    names = [e["piece"] for e in record["plan"][1:] if left(e)]
    if not names:
        return None
    return f"ZEROTUNE_GPU_KIT_ROWS={','.join(names)} bash benchmarks/gpu/run.sh {record['part']}"


def compose_row(row: rows.Row) -> tuple[DictConfig | None, str | None]:
    """The row's config as the card runs it (its steps, its offload), else the error's first line: a typo shows
    in a dry run."""
    from zerotune.config.compose import compose
    from zerotune.config.errors import ConfigError

    try:
        return compose([*row.overrides, *rows.COMMON]), None
    except ConfigError as exc:
        return None, str(exc).splitlines()[0]


class CpuAdam:
    """DeepSpeed's CPU-Adam JIT build, planned once: on the first piece that builds it, while it is not cached."""

    def __init__(self, dry_run: bool):
        from zerotune.host.ops import is_cached

        # a dry run plans for the card's first call: a bare machine, nothing built
        self.pending = dry_run or not is_cached("cpu_adam")

    def take(self) -> tuple[float, str]:
        """The build's seconds and basis for the piece that will build it (0 once planned)."""
        if not self.pending:
            return 0.0, ""
        self.pending = False
        return estimates.CPU_ADAM_BUILD_S, (f" + CPU-Adam build {estimates.CPU_ADAM_BUILD_S} s "
                                            f"({estimates.CPU_ADAM_BASIS})")


def row_pieces(part: Part, table: list[rows.Row], work: Path, dry_run: bool, cpu_adam: CpuAdam,
               kinds_run: set[str] | None) -> list[Piece]:
    """One piece per row. `kinds_run`: in a dry run of reference/grid, one row of each kind runs (shared by the
    parts of one `all`); None runs every row (`first`)."""
    chosen = [n for n in os.environ.get("ZEROTUNE_GPU_KIT_ROWS", "").split(",") if n]  # rows run alone
    pieces = []
    for row in table:
        cfg, error = compose_row(row)
        skip = None
        if chosen and row.name not in chosen:
            skip = "not run: not in ZEROTUNE_GPU_KIT_ROWS"
        elif error:
            skip = f"config error: {error}"
        elif dry_run and kinds_run is not None and row.kind in kinds_run:
            skip = "not run: a dry run runs one row of each kind"
        elif kinds_run is not None:
            kinds_run.add(row.kind)
        steps = int(cfg.train.max_steps) if cfg is not None else 0
        seconds, basis = row.cost.seconds(steps), row.cost.describe(steps)
        if not skip and cfg is not None and cfg.offload.device in ("cpu", "nvme"):  # DeepSpeed's CPU-Adam steps it
            build_s, build_basis = cpu_adam.take()
            seconds, basis = seconds + build_s, basis + build_basis
        reference = reference_of(cfg)
        pieces.append(Piece(row.name, seconds, basis,
                            rows.shown(row, rows.command(row, Path("<work>") / row.name, dry_run, 0)),
                            run=lambda limit, row=row: run_row(part, row, work, dry_run, limit),
                            not_run=lambda why, row=row, ref=reference: part.record["rows"].append(
                                rows.skipped(row, why, dry_run, ref)),
                            skip=skip))
    return pieces


def reference_of(cfg: DictConfig | None) -> dict | None:
    """The experiment's reference figures (SimpleTuner's), as the run's summary.json gives them; None without."""
    if cfg is None or cfg.get("reference") is None:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg.reference, resolve=True)


def run_row(part: Part, row: rows.Row, work: Path, dry_run: bool, limit: float) -> str:
    record = rows.run_row(row, work, dry_run, limit)
    part.record["rows"].append(record)
    return record["status"]


def env_piece(target: dict, work: Path, dry_run: bool, build: bool, cpu_adam: CpuAdam) -> Piece:
    """The probe (env_probe.py) in a fresh process; its answer goes into `target`. `build`: time CPU-Adam's
    build in the probe (the `env` part) rather than leave it to the first row with offload=cpu (`first`)."""
    result = work / "env_probe.json"
    cmd = [sys.executable, str(Path(__file__).parent / "env_probe.py"), str(result), *(["--dry-run"] * dry_run),
           *([] if build else ["--no-build"])]
    target.update(command=" ".join(cmd[1:]), probe=None, error=None)
    seconds, basis = estimates.ENV_PROBE.seconds(0), estimates.ENV_PROBE.basis
    if build:
        build_s, build_basis = cpu_adam.take()
        seconds, basis = seconds + build_s, basis + build_basis

    def run(limit: float) -> str:
        exit_code, output = rows.run_bounded(cmd, work, None, limit)
        if exit_code == 0 and result.is_file():
            target["probe"] = json.loads(result.read_text())
        else:
            target["error"] = f"exit {exit_code}: {output[-3000:]}"
        return "ok" if target["probe"] is not None else "failed"

    def not_run(why: str) -> None:
        target["error"] = why

    return Piece("env", seconds, basis, target["command"], run, not_run)


def paths_piece(part: Part, work: Path) -> Piece:
    """pytest -m cuda over tests/test_cuda_paths.py; on a machine without CUDA every test is skipped."""
    junit = work / "paths-junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "tests/test_cuda_paths.py"]
    part.record.update(command=" ".join(cmd[1:]), exit_code=None)

    def run(limit: float) -> str:
        part.record["exit_code"], output = rows.run_bounded(cmd, rows.ROOT, None, limit)
        part.record["log_tail"] = output[-3000:]
        part.record["rows"] = junit_rows(junit) if junit.is_file() else []
        return f"exit {part.record['exit_code']}"

    def not_run(why: str) -> None:
        part.record["log_tail"] = why

    return Piece("paths", estimates.PATHS.seconds(0), estimates.PATHS.basis, part.record["command"], run, not_run)


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


RENDER = {"first": report.first_markdown, "loading": report.loading_markdown, "env": report.env_markdown,
          "reference": report.runs_markdown, "grid": report.runs_markdown, "paths": report.paths_markdown,
          "flux": report.runs_markdown}


def run_part(name: str, out: Path, work: Path, dry_run: bool, started: float, first_of_call: bool,
             kinds_run: set[str]) -> dict:
    part_work = work / name
    part_work.mkdir(parents=True, exist_ok=True)
    part = Part(name, out, dry_run, RENDER[name], started)
    install = install_entry(part, dry_run, first_of_call)
    cpu_adam = CpuAdam(dry_run)
    if name == "first":  # the environment, then the two reference rows, each with the planner's prediction
        part.record["env"] = {}
        pieces = [env_piece(part.record["env"], part_work, dry_run, False, cpu_adam),
                  *row_pieces(part, parts.FIRST, part_work, dry_run, cpu_adam, None)]
    elif name == "loading":  # every row, in order, as far as the budget goes (a dry run too: its rows are quick)
        pieces = row_pieces(part, parts.LOADING, part_work, dry_run, cpu_adam, None)
        return run_plan(part, pieces, install, within_budget=True)
    elif name == "env":
        pieces = [env_piece(part.record, part_work, dry_run, True, cpu_adam)]
    elif name == "paths":
        pieces = [paths_piece(part, part_work)]
    else:
        table = {"reference": parts.REFERENCE, "grid": parts.GRID, "flux": parts.FLUX}[name]
        pieces = row_pieces(part, table, part_work, dry_run, cpu_adam, kinds_run)
    return run_plan(part, pieces, install)


def command_started() -> float:
    """When the command began (run.sh's GPU_KIT_STARTED, before its install), else now."""
    return float(os.environ.get("GPU_KIT_STARTED") or time.time())


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
    names = ALL if args.part == "all" else (args.part,)
    for name in names:
        # the call's first part counts from the command's start; in `all` each later part has a budget of its own
        first_of_call = name == names[0]
        started = command_started() if first_of_call else time.time()
        record = run_part(name, args.out.resolve(), args.work.resolve(), args.dry_run, started, first_of_call,
                          kinds_run)
        print(f"gpu kit: {name}: {'complete' if record['complete'] else 'INCOMPLETE'} in {record['wall_s']} s "
              f"-> {args.out / (name + '.json')}, {args.out / (name + '.md')}", flush=True)
        if record.get("later_call"):
            print(f"gpu kit: {name}: the rows not run, in a later call: {record['later_call']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

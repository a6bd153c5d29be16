"""Sweep directories read into flat rows (plain dicts, see `Row keys` below), one per job whatever state it was left
in, with the planner's prediction beside the measurement (plan_* keys, measured / predicted ratios). None means
"unmeasured" or "unpredicted", never 0, and every consumer of these rows keeps that distinction."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from zerotune.rundir.plan import Plan
from zerotune.rundir.summary import SUMMARY, JsonDict, NotAnObject, RunSummary, Status

# Row key -> field of summary.json's `plan` (rundir.plan.Plan).
PLAN_FIELDS = {"plan_gpu_peak_mib": "gpu_peak_mib", "plan_host_peak_mib": "host_peak_mib",
               "plan_nvme_mib": "nvme_mib", "plan_time_floor_s": "time_floor_s"}
PLAN_ERROR = "plan_error"
# Measured memory key -> the predicted figure for the same quantity (what the budget falls back to).
PREDICTED_FOR = {"gpu_peak_process_mib": "plan_gpu_peak_mib", "host_peak_rss_mib": "plan_host_peak_mib",
                 "nvme_peak_mib": "plan_nvme_mib"}
PLAN_TIME_KEY = "plan_time_floor_s"
# What the plan's host figure predicts (summary.json plan.host_peak_kind). Only "process_rss" (plan/host_memory.py:
# a CPU run's processes, interpreter and imports included) describes the measured host peak, the job tree's
# RSS; any other host figure (a GPU plan's pinned buffers and offloaded states) gets no host ratio.
PLAN_HOST_KIND = "plan_host_peak_kind"
PROCESS_RSS = "process_rss"
HOST_RATIO = "host_peak_measured_over_predicted"
# (ratio column, measured key, predicted key): measured / predicted.
RATIOS = (("gpu_peak_measured_over_predicted", "gpu_peak_process_mib", "plan_gpu_peak_mib"),
          ("host_peak_measured_over_predicted", "host_peak_rss_mib", "plan_host_peak_mib"),
          ("step_time_over_floor", "step_time_median_s", "plan_time_floor_s"))


def plan_figures(plan: Plan | None) -> dict[str, Any]:
    """{row key: value} for PLAN_FIELDS' keys and PLAN_ERROR from a summary's plan (any of them None when absent)."""
    row: dict[str, Any] = dict.fromkeys(PLAN_FIELDS)
    row[PLAN_ERROR] = row[PLAN_HOST_KIND] = None
    if plan is None:
        return row
    if plan.error:  # the planner failed: its other keys, if any, are not a prediction
        row[PLAN_ERROR] = plan.error  # as written; collect shortens it like a job's error
        return row
    row.update({key: _number(getattr(plan, name)) for key, name in PLAN_FIELDS.items()})
    run_peak = _number(plan.run_peak_mib)
    if run_peak is not None:  # nvidia-smi's peak is the whole run's: its phases (plan/phases.py)
        row["plan_gpu_peak_mib"] = max(run_peak, row["plan_gpu_peak_mib"] or 0.0)
    kind = plan.host_peak_kind
    row[PLAN_HOST_KIND] = kind if isinstance(kind, str) else None
    return row


def not_comparable(row: dict, ratio_key: str) -> bool:
    """Whether both sides of a ratio are there but the prediction does not describe the measurement: the host
    ratio of a plan whose host figure is not a process-RSS prediction. Such a ratio is never printed."""
    if ratio_key != HOST_RATIO or row.get(PLAN_HOST_KIND) == PROCESS_RSS:
        return False
    return row.get("host_peak_rss_mib") is not None and row.get("plan_host_peak_mib") is not None


def shown_ratio(row: dict, ratio_key: str, measured_key: str, predicted_key: str) -> float | None:
    """The ratio a report prints, measured / predicted: None where either side is missing (or the prediction is not
    positive) or the two do not describe the same thing."""
    measured, predicted = row.get(measured_key), row.get(predicted_key)
    if measured is None or predicted is None or predicted <= 0 or not_comparable(row, ratio_key):
        return None
    return measured / predicted


def has_plan(rows: list[dict]) -> bool:
    """Whether any row carries a plan (figures or a planner error): else the plan columns are left out."""
    return any(row.get(k) is not None for row in rows for k in (*PLAN_FIELDS, PLAN_ERROR))


def _number(value: Any) -> float | None:
    # bool is an int to Python, and a NaN would read as a figure: neither is a prediction.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


OVERRIDES = Path(".hydra") / "overrides.yaml"

MEMORY_KEYS = ("gpu_peak_process_mib", "gpu_peak_device_mib", "gpu_peak_allocated_mib",
               "gpu_peak_reserved_mib", "host_peak_rss_mib", "nvme_peak_mib")
PERF_KEYS = ("step_time_median_s", "step_time_p90_s", "samples_per_s", "startup_s")
MAX_RANK_KEY = "gpu_peak_process_mib_max_rank"  # summary.json's memory entry for multi-process jobs
# The U-Net's parameters the optimizer trains and those it leaves frozen (an adapter's base).
PARAM_COUNT_KEYS = ("trainable_params", "frozen_params")
# Row keys: sweep_dir, job, run_dir, status, oom_kind, params, overrides, choices, error, experiment, device,
# steps, loss_first, loss_last, wall_time_s, plus every name in MEMORY_KEYS, PERF_KEYS and PARAM_COUNT_KEYS,
# and the prediction's plan_* keys and plan_error (plan_columns.py) -- all None when absent.

# A report row's status where a job has no readable summary.json: a row's, not a run's (rundir/summary.py).
MISSING, RUNNING = "missing", "running"
# A job directory without summary.json that changed this recently is taken for a job still running.
RUNNING_WINDOW_S = 300.0

# The summary's `choices` in their report order; they name a configuration.
CHOICE_ORDER = ("zero_stage", "offload", "resolution", "batch_size", "grad_accum", "optimizer", "scheduler",
                "precision", "model", "adapter", "data", "gradient_checkpointing", "world_size")
# What summaries written before adapters existed trained: the whole U-Net (their choices have no `adapter`).
NO_ADAPTER = "none"
# Override keys that set one of the `choices`: a sweep over `train.batch_size` is a sweep over batch_size.
OVERRIDE_TO_CHOICE = {
    "zero_stage.stage": "zero_stage", "offload.device": "offload", "resolution.size": "resolution",
    "train.batch_size": "batch_size", "train.grad_accum": "grad_accum",
    "train.gradient_checkpointing": "gradient_checkpointing",
    **{k: k for k in CHOICE_ORDER},
}
# Shown for an override-only key in a job that did not override it (its value is the config's default).
DEFAULT = "(default)"
IGNORED_PREFIXES = ("report.", "hydra.")
# Keys that identify a job when no key varies across the jobs (a single run, say).
IDENTITY_KEYS = ("zero_stage", "offload", "resolution", "batch_size")


class NoRunsError(ValueError):
    """A directory given to the report holds no run directory."""

    def __init__(self, path: Path):
        super().__init__(f"{path} holds no runs (no job folder with summary.json or .hydra/)")


def collect_runs(dirs: Iterable[str | Path], running_window_s: float = RUNNING_WINDOW_S) -> list[dict]:
    """Rows for every job in the given sweep directories (merged in order); a single run directory or a
    folder of sweeps (multirun/, multirun/<date>/) works too.

    Raises FileNotFoundError for a path that doesn't exist and NoRunsError for one that holds no runs.
    """
    rows: list[dict] = []
    for d in dirs:
        path = Path(d)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if is_run_dir(path):  # a single run: its parent is the sweep (or outputs/<date>) folder
            rows.append(read_job(path.parent, path, running_window_s))
            continue
        sweeps = find_sweeps(path)
        if not sweeps:
            raise NoRunsError(path)
        rows.extend(read_job(sweep, job, running_window_s) for sweep in sweeps for job in job_dirs(sweep))
    _fill_override_defaults(rows)
    return rows


def is_run_dir(path: Path) -> bool:
    return (path / SUMMARY).is_file() or (path / OVERRIDES).is_file()


def find_sweeps(path: Path, depth: int = 2) -> list[Path]:
    """`path` if it holds jobs, else the sweeps below it: multirun/ -> <date>/ -> <time>/ is two levels."""
    if job_dirs(path):
        return [path]
    if depth <= 0 or not path.is_dir():
        return []
    return [s for child in sorted(p for p in path.iterdir() if p.is_dir()) for s in find_sweeps(child, depth - 1)]


def job_dirs(sweep: Path) -> list[Path]:
    """Job folders in a sweep: Hydra numbers them; a numbered folder counts even when still empty."""
    if not sweep.is_dir():
        return []
    found = [p for p in sweep.iterdir() if p.is_dir() and (p.name.isdigit() or is_run_dir(p))]
    return sorted(found, key=lambda p: numbers_first(p.name))


def numbers_first(name: str) -> tuple:
    """Orders names: numbers by value (job 2 before job 10, resolution 8 before 16), then the others by name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def read_job(sweep: Path, job: Path, running_window_s: float = RUNNING_WINDOW_S) -> dict:
    overrides = read_overrides(job)
    row: dict[str, Any] = {"sweep_dir": str(sweep), "job": job.name, "run_dir": str(job),
                           "overrides": overrides, "error": None, "experiment": None, "device": None,
                           "choices": {}, "oom_kind": None}
    summary, problem = _read_summary(job)
    if summary is None:
        row["status"] = RUNNING if _recently_changed(job, running_window_s) else MISSING
        row["error"] = problem
        summary = RunSummary()
    else:
        row["status"] = str(summary.status or summary.extra.get("status") or MISSING)
        row["oom_kind"] = oom_kind(row["status"], summary.error)
        row["error"] = short_error(summary.error)
        row["experiment"] = summary.experiment
        row["device"] = (summary.env or {}).get("device_name")
        slurm = summary.slurm or {}
        row["slurm_job"] = slurm.get("array_job") or slurm.get("job_id")
        row["choices"] = _choices(summary)
    memory, perf = summary.memory or {}, summary.perf or {}
    row.update({k: memory.get(k) for k in MEMORY_KEYS})
    # With several ranks the top-level figure is rank 0's; what has to fit a GPU is the busiest rank's.
    busiest = [v for v in (row["gpu_peak_process_mib"], memory.get(MAX_RANK_KEY)) if v is not None]
    row["gpu_peak_process_mib"] = max(busiest) if busiest else None
    row.update({k: perf.get(k) for k in PERF_KEYS})
    row.update({"steps": summary.steps, "loss_first": summary.loss_first, "loss_last": summary.loss_last,
                "wall_time_s": summary.wall_time_s})
    row.update(_param_counts(summary, row["choices"]))
    row.update(plan_figures(summary.plan))
    row[PLAN_ERROR] = short_error(row[PLAN_ERROR])
    row["params"] = _params(row["choices"], overrides)
    return row


def oom_kind(status: str, error: Any) -> str | None:
    """Which memory ran out in an OOM job: "host" where the kernel's OOM killer ended it (its error says
    kind "host"), "gpu" for a worker's CUDA out-of-memory error, None where the summary does not say."""
    if status != Status.OOM or not isinstance(error, dict):
        return None
    if error.get("kind"):
        return str(error["kind"])
    return "gpu" if error.get("type") == "OutOfMemoryError" else None


def status_word(row: dict) -> str:
    """The status as counts name it: `oom (host)` where the host's memory ran out."""
    return f"{Status.OOM} ({row['oom_kind']})" if row["status"] == Status.OOM and row.get("oom_kind") == "host" \
        else row["status"]


def status_counts(rows: list[dict]) -> str:
    """`2 oom, 1 failed` (empty for no rows)."""
    return ", ".join(f"{n} {s}" for s, n in sorted(Counter(status_word(r) for r in rows).items()))


def _choices(summary: RunSummary) -> JsonDict:
    choices = dict(summary.choices or {})
    if choices and "adapter" not in choices:  # a summary from before adapters: full training
        choices["adapter"] = NO_ADAPTER
    return choices


def _param_counts(summary: RunSummary, choices: JsonDict) -> dict[str, int | None]:
    """Trainable and frozen parameters; a summary from before adapters trained all `num_params`."""
    counts = {"trainable_params": _count(summary.trainable_params), "frozen_params": _count(summary.frozen_params)}
    total = _count(summary.num_params)
    if counts["trainable_params"] is None and total is not None and choices.get("adapter") == NO_ADAPTER:
        counts = {"trainable_params": total, "frozen_params": 0}
    return counts


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_overrides(job: Path) -> dict[str, Any]:
    """{key: value} from the job's Hydra overrides (read by Hydra's own parser); deletions (~key) and
    unparsable files are skipped."""
    file = job / OVERRIDES
    try:
        items = yaml.safe_load(file.read_text()) if file.is_file() else []
        parsed = OverridesParser.create().parse_overrides([str(i) for i in items]) if isinstance(items, list) else []
    except (OSError, yaml.YAMLError, OverrideParseException):
        return {}
    return {o.key_or_group: parse_value(o.value()) for o in parsed if not o.is_delete()}


def parse_value(text: Any) -> Any:
    """A value as a number, bool or null where it reads as one (`--where resolution=1024`). Hydra keeps a quoted
    override a string (zerotune writes zero_stage='2'); a report compares numbers. Not a string: as it is."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def short_error(error: Any, limit: int = 120) -> str | None:
    """`Type: first line of the message`, cut to `limit` characters."""
    if not error:
        return None
    if not isinstance(error, dict):
        error = {"message": str(error)}
    message = str(error.get("message") or "").strip().splitlines()
    text = ": ".join(p for p in (error.get("type"), message[0] if message else "") if p)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def swept_keys(rows: list[dict]) -> list[str]:
    """Keys whose values differ across the rows, overridden keys first (in the order Hydra wrote them)."""
    candidates: list[str] = []
    for row in rows:
        for key in row["overrides"]:
            name = OVERRIDE_TO_CHOICE.get(key, key)
            if name not in candidates:
                candidates.append(name)
    candidates += [k for k in CHOICE_ORDER if k not in candidates]
    # report.* configures this report, not the run: it never tells two configurations apart.
    candidates = [k for k in candidates if not k.startswith(IGNORED_PREFIXES)]
    swept = [k for k in candidates if len(_distinct(rows, k)) > 1]
    if swept:
        return swept
    # Nothing varies (one job, or identical jobs): show what identifies the configuration instead.
    present = [k for k in candidates if _distinct(rows, k)]
    overridden = [k for k in present if k not in CHOICE_ORDER or k in _overridden_choices(rows)]
    return [k for k in IDENTITY_KEYS if k in present] + [k for k in overridden if k not in IDENTITY_KEYS]


def sort_key(value: Any) -> tuple:
    """Orders mixed values: numbers (numerically), then strings, then None."""
    if isinstance(value, bool):
        return (1, str(value), 0.0)
    if isinstance(value, (int, float)):
        return (0, "", float(value))
    return (2, "", 0.0) if value is None else (1, str(value), 0.0)


def _distinct(rows: list[dict], key: str) -> set:
    # A choice that is None is unknown (the job left no summary), so it doesn't count as a value.
    return {repr(r["params"].get(key)) for r in rows if r["params"].get(key) is not None}


def _overridden_choices(rows: list[dict]) -> set[str]:
    return {OVERRIDE_TO_CHOICE[k] for r in rows for k in r["overrides"] if k in OVERRIDE_TO_CHOICE}


def _params(choices: dict, overrides: dict) -> dict[str, Any]:
    """The job's configuration values: its `choices`, with overrides filling in what they don't name."""
    params = dict(choices)
    for key, value in overrides.items():
        name = OVERRIDE_TO_CHOICE.get(key, key)
        if params.get(name) is None:
            params[name] = value
    return params


def _fill_override_defaults(rows: list[dict]) -> None:
    """An override-only key (optimizer.lr=...) set in some jobs only: the others ran with the default."""
    keys = {OVERRIDE_TO_CHOICE.get(k, k) for r in rows for k in r["overrides"]} - set(CHOICE_ORDER)
    for row in rows:
        for key in keys:
            row["params"].setdefault(key, DEFAULT)


def _read_summary(job: Path) -> tuple[RunSummary | None, str | None]:
    try:
        return RunSummary.read(job), None
    except NotAnObject:
        return None, f"{SUMMARY} is not a JSON object"
    except (OSError, ValueError) as exc:
        return None, f"{SUMMARY} unreadable: {type(exc).__name__}: {exc}"[:120]


def _recently_changed(job: Path, window_s: float) -> bool:
    if window_s <= 0:
        return False
    try:
        newest = max([job.stat().st_mtime, *(p.stat().st_mtime for p in job.iterdir())])
    except OSError:
        return False
    return time.time() - newest < window_s

"""The planner's prediction beside the measurement: the `plan` object of summary.json as row keys, and
measured / predicted ratios.

A predicted figure is None where the job has no plan (runs older than the planner), where the planner
failed (`plan` is {"error": ...}) or where the plan left that figure out: None means "unpredicted",
never 0, just as a measured None means "unmeasured".
"""

from __future__ import annotations

import math
from typing import Any

from zerotune.rundir.plan import Plan

# Row key -> field of summary.json's `plan` (rundir.plan.Plan).
PLAN_FIELDS = {"plan_gpu_peak_mib": "gpu_peak_mib", "plan_host_peak_mib": "host_peak_mib",
               "plan_nvme_mib": "nvme_mib", "plan_time_floor_s": "time_floor_s"}
PLAN_ERROR = "plan_error"
# Measured memory key -> the predicted figure for the same quantity (what the budget falls back to).
PREDICTED_FOR = {"gpu_peak_process_mib": "plan_gpu_peak_mib", "host_peak_rss_mib": "plan_host_peak_mib",
                 "nvme_peak_mib": "plan_nvme_mib"}
PLAN_TIME_KEY = "plan_time_floor_s"
# What the plan's host figure predicts (summary.json plan.host_peak_kind). Only "process_rss" (plan/process.py:
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

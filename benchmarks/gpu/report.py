"""Each part's Markdown table, from the same record as its JSON. A missing figure reads "unmeasured"."""

from __future__ import annotations


def fmt(value, digits: int = 0) -> str:
    if value is None:
        return "unmeasured"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float | int):
        return f"{value:,.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def title(record: dict) -> list[str]:
    mode = "dry run on the CPU (tiny shapes; GPU figures unmeasured)" if record["dry_run"] else "on the GPU"
    done = "complete" if record["complete"] else "INCOMPLETE (stopped early)"
    return [f"# GPU kit: {record['part']}", "", f"{mode}; {done}; wall {fmt(record['wall_s'], 1)} s of a "
            f"{fmt(record['budget_s'])} s budget; host {record['host']}; {record['started']}", ""]


def verdict(record: dict) -> str:
    spare = record["budget_s"] - record["plan_total_s"]
    if spare >= 0:
        return f"of {record['budget_s']:.0f} s: fits, {spare:.0f} s to spare"
    return (f"of {record['budget_s']:.0f} s: over by {-spare:.0f} s; a piece whose estimate is more than the time "
            "left at its turn is not run")


def plan_text(record: dict) -> str:
    """The plan as the kit prints it before it starts: each piece's estimated seconds on an H100 (a dry run's are
    the card's too), and the total against the budget."""
    lines = [f"gpu kit: {record['part']}: plan, estimated seconds on an H100 (benchmarks/gpu/estimates.py, from "
             f"{record['estimates_from']}), budget {record['budget_s']:.0f} s from the command's start"]
    for entry in record["plan"]:
        status = "" if entry["status"] in ("planned", "done") else f"[{entry['status']}] "
        lines.append(f"gpu kit:   {entry['piece']:<28} {entry['estimate_s']:>6.1f} s  {status}{entry['basis']}")
    lines.append(f"gpu kit:   {'total':<28} {record['plan_total_s']:>6.1f} s  {verdict(record)}")
    return "\n".join(lines)


def plan_markdown(record: dict) -> list[str]:
    out = ["## Plan: estimated seconds on an H100 against the budget", "",
           f"Estimates from `benchmarks/gpu/estimates.py` (the recorded runs in `{record['estimates_from']}`); "
           "wall: this call's own seconds.", ""]
    out += table(["piece", "estimated s", "from", "status", "wall s"],
                 [[e["piece"], fmt(e["estimate_s"], 1), fmt(e["basis"]),
                   fmt(e["status"] + (f": {e['outcome']}" if e.get("outcome") else "")), fmt(e["wall_s"], 1)]
                  for e in record["plan"]])
    return out + ["", f"Planned in all: {fmt(record['plan_total_s'], 1)} s {verdict(record)}.", ""]


def predicted_peak(predicted: dict) -> str:
    """The planner's peak the ratio uses: the run's (with its phase) where it has phases, else the step's."""
    if predicted.get("run_peak_mib") is not None:
        return f"{fmt(predicted['run_peak_mib'])} ({fmt(predicted.get('run_peak_phase'))})"
    return fmt(predicted.get("gpu_peak_mib"))


def runs_markdown(record: dict) -> str:
    """reference / grid: the plan, then predicted against measured, one line per row."""
    return "\n".join(title(record) + plan_markdown(record) + rows_section(record["rows"])) + "\n"


def rows_section(records: list[dict]) -> list[str]:
    header = ["row", "status", "predicted peak MiB", "nvidia-smi peak MiB", "predicted / measured", "allocated MiB",
              "reserved MiB", "s/step", "steps", "note"]
    lines = []
    for r in records:
        m, p = r["measured"], r.get("predicted") or {}
        lines.append([r["name"], fmt(r["status"]), predicted_peak(p), fmt(m["gpu_peak_process_mib"]),
                      fmt(r.get("ratio"), 3), fmt(m["gpu_peak_allocated_mib"]), fmt(m["gpu_peak_reserved_mib"]),
                      fmt(m["step_time_median_s"], 2), fmt(m["steps"]), fmt(r.get("note", ""))])
    out = table(header, lines)
    by_phase = [r for r in records if r.get("phases_torch")]
    if by_phase:
        out += ["", "## torch's peaks in each phase, beside the planner's (MiB)", ""]
        out += table(["row", "phase", "seconds", "allocated peak", "reserved peak", "planner's peak"],
                     [[r["name"], ph["phase"], fmt(ph["seconds"], 1), fmt(ph["gpu_max_allocated_mib"]),
                       fmt(ph["gpu_max_reserved_mib"]), planner_phase(r, ph["phase"])]
                      for r in by_phase for ph in r["phases_torch"]])
    built = [r for r in records if (r.get("ops_build") or {}).get("ops")]
    if built:
        out += ["", "## DeepSpeed ops the rows built or loaded", ""]
        out += table(["row", "op", "seconds", "was cached"],
                     [[r["name"], op["name"], fmt(op["seconds"], 1), fmt(op["was_cached"])]
                      for r in built for op in r["ops_build"]["ops"]])
    phased = [r for r in records if r.get("phases_measured")]
    if phased:
        out += ["", "## Memory after each phase (same process)", ""]
        out += table(["row", "phase", "NVML device used MiB", "torch allocated MiB", "torch reserved MiB"],
                     [[r["name"], m["phase"], fmt(m["nvml_device_used_mib"]), fmt(m["torch_allocated_mib"]),
                       fmt(m["torch_reserved_mib"])] for r in phased for m in r["phases_measured"]["marks"]])
    terms = [r for r in records if (r.get("predicted") or {}).get("gpu_terms")]
    if terms:
        out += ["", "## The planner's GPU terms (MiB)", ""]
        out += table(["row", "terms"], [[r["name"], ", ".join(f"{t['term']} {t['mib']:,.0f}"
                                                              for t in r["predicted"]["gpu_terms"])] for r in terms])
    return out


def planner_phase(row: dict, phase: str) -> str:
    for predicted in (row.get("predicted") or {}).get("phases") or []:
        if predicted.get("phase") == phase:
            return fmt(predicted.get("peak_mib"))
    return "no prediction"


def first_markdown(record: dict) -> str:
    """The first call: the plan, the environment, then the two reference rows beside the planner's prediction."""
    out = title(record) + plan_markdown(record) + ["## Environment", ""] + env_section(record["env"])
    out += ["", "## The reference rows, beside the planner's prediction", ""] + rows_section(record["rows"])
    return "\n".join(out) + "\n"


def env_markdown(record: dict) -> str:
    return "\n".join(title(record) + plan_markdown(record) + env_section(record)) + "\n"


def env_section(env: dict) -> list[str]:
    probe = env.get("probe") or {}
    out = []
    if env.get("error"):
        out += [f"probe failed or not run: {fmt(env['error'])}", ""]
    out += table(["what", "value"], [[k, fmt(v)] for k, v in (probe.get("versions") or {}).items()])
    out += ["", "## Memory after each first use", ""]
    out += table(["step", "nvidia-smi device MiB", "nvidia-smi process MiB", "torch allocated MiB",
                  "torch reserved MiB", "seconds"],
                 [[u["step"], fmt(u["smi_device_used_mib"]), fmt(u["smi_process_used_mib"]),
                   fmt(u["torch_allocated_mib"]), fmt(u["torch_reserved_mib"]), fmt(u["seconds"], 3)]
                  for u in probe.get("first_uses") or []])
    out += ["", "## DeepSpeed's ops (compatible: could JIT-build here; none built by the probe)", ""]
    out += table(["op", "compatible", "built"],
                 [[op["op"], fmt(op["compatible"]), fmt(op["built"])] for op in probe.get("ops") or []])
    adam = probe.get("cpu_adam") or {}
    out += ["", "## DeepSpeed CPU-Adam", ""]
    out += table(["op", "build or load s", "was cached", "error or why not built"],
                 [[fmt(adam.get("op")), fmt(adam.get("seconds"), 1), fmt(adam.get("was_cached")),
                   fmt(adam.get("error") or adam.get("skipped") or "none")]])
    return out


def paths_markdown(record: dict) -> str:
    out = title(record) + plan_markdown(record) + [f"`{record['command']}`: exit {record['exit_code']}", ""]
    out += table(["test", "outcome", "seconds", "message"],
                 [[r["name"], r["outcome"], fmt(r["seconds"], 1), fmt(r.get("message") or "")]
                  for r in record["rows"]])
    return "\n".join(out) + "\n"

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
    if record.get("past_budget_s"):
        lines.append(f"gpu kit:   {'past the budget':<28} {record['past_budget_s']:>6.1f} s  {PAST_TEXT}; the "
                     f"rest in a later call: {record['later_call']}")
    return "\n".join(lines)


PAST_TEXT = "not in the total: each runs if its estimate fits what is left at its turn"


def plan_markdown(record: dict) -> list[str]:
    out = ["## Plan: estimated seconds on an H100 against the budget", "",
           f"Estimates from `benchmarks/gpu/estimates.py` (the recorded runs in `{record['estimates_from']}`); "
           "wall: this call's own seconds.", ""]
    out += table(["piece", "estimated s", "from", "status", "wall s"],
                 [[e["piece"], fmt(e["estimate_s"], 1), fmt(e["basis"]),
                   fmt(e["status"] + (f": {e['outcome']}" if e.get("outcome") else "")), fmt(e["wall_s"], 1)]
                  for e in record["plan"]])
    out += ["", f"Planned in all: {fmt(record['plan_total_s'], 1)} s {verdict(record)}."]
    if record.get("past_budget_s"):
        out += ["", f"Past the budget: {fmt(record['past_budget_s'], 1)} s, {PAST_TEXT}."]
    if record.get("later_call"):
        out += ["", f"Not run, for a later call: `{record['later_call']}`"]
    return out + [""]


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
    return out + later_sections(records)


def later_sections(records: list[dict]) -> list[str]:
    """The ops the rows built, phases.py's marks, the planner's GPU terms: where any row has them."""
    out = []
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


def loading_markdown(record: dict) -> str:
    """`loading`: the plan; each row's nvidia-smi peak beside SimpleTuner's figure (with the ratio) and the
    planner's; each row against the row it changes one thing of; torch's and the host's peaks in each phase."""
    rows = record["rows"]
    out = title(record) + plan_markdown(record)
    out += ["## The rows: nvidia-smi's peak beside SimpleTuner's figure and the planner's", "",
            "K: the optimizer groups the run's engine was given (deepspeed.param_groups, from its resolved.json). "
            "Reference: SimpleTuner's figure for the same job (RTX 4090, its nvidia-smi), from the experiment; "
            "measured / reference under 1 beats it. Allocated / reserved: torch's peaks over the run. Host: peak "
            "RSS, the planner's in brackets. s/step: zerotune's median, after its warm-up steps.", ""]
    out += table(["row", "status", "K", "reference MiB", "nvidia-smi peak MiB", "measured / reference",
                  "planner's run peak MiB", "predicted / measured", "allocated / reserved MiB",
                  "host peak RSS MiB (planner)", "s/step", "steps", "note"],
                 [loading_line(r) for r in rows])
    out += ["", "## Each row against the row it changes one thing of", ""]
    out += table(["row", "against", "nvidia-smi peak MiB", "difference MiB", "reserved peak MiB", "s/step",
                  "s/step ratio"], [against_line(r, {x["name"]: x for x in rows}) for r in rows if r.get("against")])
    by_phase = [r for r in rows if r.get("phases_torch")]
    if by_phase:
        out += ["", "## Each phase: torch's peaks and the host's, beside the planner's (MiB)", ""]
        out += table(["row", "phase", "seconds", "allocated peak", "reserved peak", "planner's peak",
                      "host peak RSS"],
                     [[r["name"], ph["phase"], fmt(ph["seconds"], 1), fmt(ph["gpu_max_allocated_mib"]),
                       fmt(ph["gpu_max_reserved_mib"]), planner_phase(r, ph["phase"]), fmt(ph.get("host_peak_rss_mib"))]
                      for r in by_phase for ph in r["phases_torch"]])
    return "\n".join(out + later_sections(rows)) + "\n"


def loading_line(r: dict) -> list[str]:
    m, p = r["measured"], r.get("predicted") or {}
    reference = (r.get("reference") or {}).get("gpu_peak_process_mib")
    against = (m["gpu_peak_process_mib"] / reference) if m["gpu_peak_process_mib"] and reference else None
    host = f"{fmt(m['host_peak_rss_mib'])} ({fmt(p.get('host_peak_mib'))})"
    return [r["name"], fmt(r["status"]), fmt(r.get("param_groups")), fmt(reference), fmt(m["gpu_peak_process_mib"]),
            fmt(against, 3), predicted_peak(p), fmt(r.get("ratio"), 3),
            f"{fmt(m['gpu_peak_allocated_mib'])} / {fmt(m['gpu_peak_reserved_mib'])}", host,
            fmt(m["step_time_median_s"], 2), fmt(m["steps"]), fmt(r.get("note", ""))]


def against_line(r: dict, by_name: dict) -> list[str]:
    m = r["measured"]
    o = (by_name.get(r["against"]) or {}).get("measured") or {}
    peak, other = m["gpu_peak_process_mib"], o.get("gpu_peak_process_mib")
    step, other_step = m["step_time_median_s"], o.get("step_time_median_s")
    return [r["name"], r["against"], f"{fmt(peak)} / {fmt(other)}",
            fmt(peak - other if peak is not None and other is not None else None),
            f"{fmt(m['gpu_peak_reserved_mib'])} / {fmt(o.get('gpu_peak_reserved_mib'))}",
            f"{fmt(step, 2)} / {fmt(other_step, 2)}", fmt(step / other_step if step and other_step else None, 3)]


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

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


def runs_markdown(record: dict) -> str:
    """reference / grid: predicted against measured, one line per row."""
    header = ["row", "status", "predicted MiB", "nvidia-smi peak MiB", "predicted / measured", "allocated MiB",
              "reserved MiB", "s/step", "steps", "note"]
    lines = []
    for r in record["rows"]:
        m, p = r["measured"], r.get("predicted") or {}
        lines.append([r["name"], fmt(r["status"]), fmt(p.get("gpu_peak_mib")), fmt(m["gpu_peak_process_mib"]),
                      fmt(r.get("ratio"), 3), fmt(m["gpu_peak_allocated_mib"]), fmt(m["gpu_peak_reserved_mib"]),
                      fmt(m["step_time_median_s"], 2), fmt(m["steps"]), fmt(r.get("note", ""))])
    out = title(record) + table(header, lines)
    phased = [r for r in record["rows"] if r.get("phases_measured")]
    if phased:
        out += ["", "## Memory after each phase (same process)", ""]
        out += table(["row", "phase", "NVML device used MiB", "torch allocated MiB", "torch reserved MiB"],
                     [[r["name"], m["phase"], fmt(m["nvml_device_used_mib"]), fmt(m["torch_allocated_mib"]),
                       fmt(m["torch_reserved_mib"])] for r in phased for m in r["phases_measured"]["marks"]])
    terms = [r for r in record["rows"] if (r.get("predicted") or {}).get("gpu_terms")]
    if terms:
        out += ["", "## The planner's GPU terms (MiB)", ""]
        out += table(["row", "terms"], [[r["name"], ", ".join(f"{t['term']} {t['mib']:,.0f}"
                                                              for t in r["predicted"]["gpu_terms"])] for r in terms])
    return "\n".join(out) + "\n"


def env_markdown(record: dict) -> str:
    probe = record["probe"] or {}
    out = title(record)
    if record.get("error"):
        out += [f"probe failed: {fmt(record['error'])}", ""]
    out += table(["what", "value"], [[k, fmt(v)] for k, v in (probe.get("versions") or {}).items()])
    out += ["", "## Memory after each first use", ""]
    out += table(["step", "nvidia-smi device MiB", "nvidia-smi process MiB", "torch allocated MiB",
                  "torch reserved MiB", "seconds"],
                 [[u["step"], fmt(u["smi_device_used_mib"]), fmt(u["smi_process_used_mib"]),
                   fmt(u["torch_allocated_mib"]), fmt(u["torch_reserved_mib"]), fmt(u["seconds"], 3)]
                  for u in probe.get("first_uses") or []])
    adam = probe.get("cpu_adam") or {}
    out += ["", "## DeepSpeed CPU-Adam", ""]
    out += table(["op", "build or load s", "was cached", "error"],
                 [[fmt(adam.get("op")), fmt(adam.get("seconds"), 1), fmt(adam.get("was_cached")),
                   fmt(adam.get("error") or "none")]])
    return "\n".join(out) + "\n"


def paths_markdown(record: dict) -> str:
    out = title(record) + [f"`{record['command']}`: exit {record['exit_code']}", ""]
    out += table(["test", "outcome", "seconds", "message"],
                 [[r["name"], r["outcome"], fmt(r["seconds"], 1), fmt(r.get("message") or "")]
                  for r in record["rows"]])
    return "\n".join(out) + "\n"

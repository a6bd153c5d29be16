"""The planner's answers as text: one job's breakdown, or the --all ranking."""

from __future__ import annotations

from collections.abc import Sequence

from zerotune.rundir.plan import PERSISTENT, Phase, Plan, Term, terms_of


def _terms(terms: Sequence[Term], unit: str = "MiB") -> list[str]:
    width = max((len(t.term) for t in terms), default=0)
    out = []
    for t in terms:
        figure = t.mib if unit == "MiB" else t.seconds
        value = "unmeasured" if figure is None else (f"{figure:>10,.1f} MiB" if unit == "MiB" else f"{figure:>10.4f} s")
        when = f"[{t.moment}] " if t.held_in != PERSISTENT else ""
        out.append(f"  {t.term:<{width}}  {value}  {when}{t.note}".rstrip())
    return out


def _device(plan: Plan) -> list[str]:
    """The step's peak on the device: held throughout, plus the largest moment's terms ([moment])."""
    moment = plan.step_peak_moment
    if plan.device == "cpu":
        return [f"the step on this CPU (one rank, what torch allocates; host memory): {plan.step_peak_mib:,.1f} MiB "
                f"at its largest moment, {moment}", *_terms(plan.step_terms)]
    gpu = plan.gpu
    card = f"{gpu['name']} ({gpu['memory_mib']:,} MiB)" if gpu else "no GPU named (--gpu NAME or --gpu-mib N)"
    verdict = {True: "fits", False: "does NOT fit", None: "-"}[plan.fits]
    return [f"GPU peak per rank: {plan.peak_mib:,.1f} MiB (the run's, in "
            f"{plan.run_peak_phase or 'step'}) on {card}: {verdict}",
            f"the step: {plan.gpu_peak_mib:,.1f} MiB at its largest moment, {moment}", *_terms(plan.gpu_terms)]


def _host(plan: Plan) -> list[str]:
    """The host terms; on a CPU plan, the processes' RSS it predicts (plan/process.py) and how."""
    process = plan.host_process_terms
    if not process:
        return _terms(plan.host_terms)
    return [f"  the job's processes (RSS): {process['source']}", *("  " + line for line in _terms(terms_of(process["terms"]))),
            "  of which tensors, and the fp32 build at load time:", *("  " + line for line in _terms(plan.host_terms))]


def micro_batch(found: dict | None) -> list[str]:
    """Which micro batch was planned and where its value came from; how to plan another, unless it was typed
    or a file of the user's gives it (there, the command line may not contradict it)."""
    if not found:
        return []
    hint = "" if found["source"] in ("command line", "file") else "; train.batch_size=N plans another"
    return [f"micro batch: {found['value']} per rank, from {found['from']}{hint}"]


def breakdown(plan: Plan) -> str:
    lines = [f"workload: {plan.workload}", *micro_batch(plan.micro_batch), *_device(plan),
             f"host peak (all {plan.world_size} ranks): {plan.host_peak_mib:,.1f} MiB", *_host(plan),
             f"NVMe: {plan.nvme_mib:,.1f} MiB", *_terms(plan.nvme_terms)]
    floor = plan.time_floor_s
    lines.append("time per step: " + ("unmeasured (no GPU figures)" if floor is None else
                                      f"at least {floor:.4f} s ({plan.bound}-bound floor)"))
    lines += _terms(plan.time_terms, unit="s")
    lines += phases(list(plan.phases))
    return "\n".join(lines)


def phases(found: list[Phase]) -> list[str]:
    """The run's phases (plan/phases.py), in run order: what nvidia-smi shows during each, its own peak, what
    earlier phases left reserved, and its terms; [] for a plan without them."""
    if not found:
        return []
    top = max(found, key=lambda p: p.reserved_mib)
    lines = [f"the run's phases (nvidia-smi during each; a freed block stays reserved until empty_cache): "
             f"peak {top.reserved_mib:,.1f} MiB in {top.phase}"]
    for p in found:
        mark = "  <- the run's peak" if p is top else ""
        lines.append(f" {p.phase}: {p.reserved_mib:,.1f} MiB reserved (own peak {p.peak_mib:,.1f}, "
                     f"{p.carried_mib:,.1f} left by earlier phases){mark}")
        lines += ["  " + line for line in _terms(p.terms)]
        lines.append(f"    source: {p.source}")
    return lines


def ranking(answer: dict) -> str:
    rows = [*micro_batch(answer.get("micro_batch")),
            f"{'option':<62} {'fits':>5} {'GPU MiB':>10} {'step MiB':>10} {'host MiB':>10} {'NVMe MiB':>9} {'floor s':>8}"]
    for r in answer["options"]:
        if r.get("refused"):
            rows.append(f"{r['option']:<62} {'-':>5}  refused: {r['refused']}")
            continue
        floor = "-" if r["time_floor_s"] is None else f"{r['time_floor_s']:.3f}"
        fits = {True: "yes", False: "no", None: "-"}[r["fits"]]
        rows.append(f"{r['option']:<62} {fits:>5} {r['peak_mib']:>10,.0f} {r['gpu_peak_mib']:>10,.0f} {r['host_peak_mib']:>10,.0f} "
                    f"{r['nvme_mib']:>9,.0f} {floor:>8}")
    rows.append("GPU MiB: the run's peak as nvidia-smi shows it (its phases); step MiB: the training step's alone")
    rec = answer["recommended"]
    rows.append(f"recommended: {rec['option'] or 'none'} ({rec['why']})")
    least = answer.get("smallest") or {}
    if least.get("option"):
        floor = least["time_floor_s"]
        rows.append(f"smallest peak: {least['option']} ({least['peak_mib']:,.0f} MiB"
                    + (f", time floor {floor:.3f} s/step)" if floor is not None else ")"))
    return "\n".join(rows)

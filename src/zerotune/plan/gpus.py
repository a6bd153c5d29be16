"""The cards a user names (`--gpu rtx4090`, plan.gpu=h100), from vendors' datasheets (dense, no 2:4 sparsity; cited
in experiments/results/planner_reference.md), and the `--all` ranking: it recommends the lowest ZeRO stage that
fits, as the reference advises (each stage up adds communication, each offload PCIe traffic and CPU work)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zerotune.config.errors import ConfigError
from zerotune.rundir.plan import Plan


@dataclass(frozen=True)
class GPU:
    name: str
    family: str             # ampere | ada | hopper: the CUDA context constant is per family
    memory_mib: int         # total, as nvidia-smi shows it
    bf16_tflops: float      # dense tensor-core peak, fp32 accumulate
    host_link_gbps: float   # PCIe x16, one direction, GB/s (what offload traffic crosses)

    def as_dict(self) -> dict:
        return asdict(self)


CATALOG: dict[str, GPU] = {g.name: g for g in (
    GPU("rtx3090", "ampere", 24576, 71.0, 31.5),
    GPU("rtx4090", "ada", 24564, 165.2, 31.5),
    GPU("l4", "ada", 23034, 121.0, 31.5),
    GPU("l40s", "ada", 46068, 362.0, 31.5),
    GPU("a100-40", "ampere", 40960, 312.0, 31.5),
    GPU("a100-80", "ampere", 81920, 312.0, 31.5),
    GPU("h100", "hopper", 81559, 989.0, 63.0),
    GPU("h200", "hopper", 143771, 989.0, 63.0),
)}


# The memory setting beside each card setting.
_MIB_KEYS = {"plan.gpu": "plan.gpu_mib", "--gpu": "--gpu-mib"}


def lookup(name: str | None, memory_mib: int | None = None, key: str = "plan.gpu") -> GPU | None:
    """The named card, or a card of `memory_mib` (a user's own budget) with no throughput figures.
    `key` names the card's setting where the user gave it (plan.gpu, --gpu, the builder page's gpu)."""
    mib_key = _MIB_KEYS.get(key, f"{key}_mib")
    if memory_mib is not None:
        if isinstance(memory_mib, bool) or not isinstance(memory_mib, int) or memory_mib < 1:
            raise ConfigError(mib_key, f"must be a positive number of MiB, got {memory_mib!r}",
                              f"e.g. {mib_key}{' ' if mib_key.startswith('--') else '='}24576")
        base = CATALOG.get(str(name).lower()) if name else None
        return GPU(base.name if base else f"{memory_mib} MiB", base.family if base else "unknown", memory_mib,
                   base.bf16_tflops if base else 0.0, base.host_link_gbps if base else 0.0)
    if name is None:
        return None
    found = CATALOG.get(str(name).lower())
    if found is None:
        raise ConfigError(key, f"unknown GPU {name!r}", f"one of: {', '.join(CATALOG)}, or give its memory with "
                          f"{mib_key}=<MiB>")
    return found


_OFFLOAD_COST = {"none": 0, "cpu": 1, "nvme": 2}


@dataclass
class Row:
    stage: int
    offload: str
    checkpointing: bool
    plan: Plan | None
    refused: str | None = None     # the validator's reason, when the combination is not allowed

    @property
    def label(self) -> str:
        return f"zero_stage={self.stage} offload={self.offload} gradient_checkpointing={str(self.checkpointing).lower()}"

    def fits(self, gpu: GPU | None, host_mib: float | None = None) -> bool | None:
        """On the card, and within `host_mib` of host memory when the user gave that budget (plan.host_mib)."""
        if self.plan is None or gpu is None:
            return None
        on_host = host_mib is None or self.plan.host_peak_mib is None or self.plan.host_peak_mib <= host_mib
        return peak_mib(self.plan) <= gpu.memory_mib and on_host


def peak_mib(plan: Plan | None) -> float:
    """What nvidia-smi would show at the run's peak: its phases' (plan/phases.py) when known, else the step's."""
    if plan is None or plan.peak_mib is None:
        raise ValueError("an option without a GPU plan has no peak")
    return plan.peak_mib


def rank(rows: list[Row], gpu: GPU | None, host_mib: float | None = None) -> dict:
    """The table (fitting options first, cheapest first) and the recommendation with its reason. `host_mib`: the
    user's host budget (plan.host_mib); None: the card alone decides what fits (a rented machine's host is not
    this one), and the recommendation says what it needs of the host."""
    # cheaper first: lower stage, then less offload, then no recomputation
    ordered = sorted(rows, key=lambda r: (r.fits(gpu, host_mib) is not True, r.plan is None, r.stage,
                                          _OFFLOAD_COST[r.offload], r.checkpointing))
    fitting = [r for r in ordered if r.fits(gpu, host_mib)]
    table = [{"option": r.label, "zero_stage": r.stage, "offload": r.offload, "gradient_checkpointing": r.checkpointing,
              "fits": r.fits(gpu, host_mib), "refused": r.refused,
              **({k: getattr(r.plan, k) for k in _FIGURES} if r.plan else {}),
              **({"peak_mib": peak_mib(r.plan)} if r.plan else {})} for r in ordered]
    return {"gpu": gpu.as_dict() if gpu else None, "host_mib": host_mib, "options": table,
            "recommended": _recommend(fitting, rows, gpu, host_mib), "smallest": _smallest(rows)}


def _smallest(rows: list[Row]) -> dict:
    """The option with the lowest run peak, whatever its time (the recommendation weighs that too)."""
    least = min((r for r in rows if r.plan), key=lambda r: peak_mib(r.plan), default=None)
    if least is None:
        return {"option": None, "peak_mib": None, "time_floor_s": None}
    return {"option": least.label, "peak_mib": peak_mib(least.plan),
            "time_floor_s": least.plan.time_floor_s if least.plan else None}


_FIGURES = ("gpu_peak_mib", "step_peak_moment", "run_peak_mib", "run_peak_phase", "host_peak_mib", "nvme_mib",
            "time_floor_s", "bound")


def _recommend(fitting: list[Row], rows: list[Row], gpu: GPU | None, host_mib: float | None = None) -> dict:
    if gpu is None:
        return {"option": None, "why": "no GPU named: give --gpu or --gpu-mib to judge what fits"}
    within = f" and {host_mib:,.0f} MiB of host memory (plan.host_mib)" if host_mib is not None else ""
    if not fitting:
        least = min((r for r in rows if r.plan), key=lambda r: peak_mib(r.plan), default=None)
        why = f"nothing fits {gpu.name} ({gpu.memory_mib:,} MiB){within}"
        if least is not None:
            why += f"; the smallest is {least.label} at {peak_mib(least.plan):,.0f} MiB: lower the batch or resolution"
        return {"option": None, "why": why}
    best = fitting[0]
    below = [r for r in rows if r.plan and r.stage < best.stage]
    why = (f"the lowest ZeRO stage that fits {gpu.name}{within}: {peak_mib(best.plan):,.0f} of {gpu.memory_mib:,} MiB "
           f"predicted, with the least offload and recomputation at that stage")
    if below:
        closest = min(below, key=lambda r: peak_mib(r.plan))
        why += f"; stage {closest.stage} needs at least {peak_mib(closest.plan):,.0f} MiB ({closest.label})"
    host = best.plan.host_peak_mib if best.plan else None
    if host_mib is None and host is not None:
        why += f"; it needs {host:,.0f} MiB of host memory (plan.host_mib=<MiB> ranks by your host's too)"
    return {"option": best.label, "why": why}

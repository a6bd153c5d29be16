"""The cards a user names (`--gpu rtx4090`, plan.gpu=h100): memory as nvidia-smi shows it, dense tensor
throughput, the host link, and the memory a CUDA process holds before its first tensor.

Figures are the vendors' datasheets (dense, i.e. without 2:4 sparsity; bf16/fp16 with fp32 accumulate)
and are cited in experiments/results/planner_reference.md. `memory_mib` is nvidia-smi's total.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zerotune.errors import ConfigError


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

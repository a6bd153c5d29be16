"""The optimizer's parameter groups: each trained module's parameters (the U-Net's, then each trained text
encoder's) cut into contiguous runs, `deepspeed.param_groups` of them in all.

Why more than one: ZeRO-1/2 (DeepSpeed 0.19.8, runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__)
take the optimizer's groups one at a time. For each, they empty the cache, flatten the group into one buffer on
the card, free the group's separate blocks, and clone the rank's partition on the card before casting it to the
master dtype (and moving it to the host under offload). With one group, the card holds the separate blocks (kept
reserved), the flat buffer and the clone at once: about 3 copies of the trained weights. With K groups, the
blocks of the groups already flattened are returned at the next group's start, so the peak is about one copy plus
2/K of one (plan/zero12.py's `loading` counts it group by group). The update is the same for any K: Adam and its
kin update element by element, and gradient clipping takes one norm over all groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerotune.config.errors import ConfigError

AUTO = "auto"
AUTO_ZERO12 = 16  # ZeRO-1/2's loading peak is then ~1.13 copies of the weights, below SDXL's training step


def check(setting: object) -> None:
    """`deepspeed.param_groups`: auto, or a whole number from 1."""
    if setting == AUTO:
        return
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError("deepspeed.param_groups", f"must be auto or a whole number from 1, got {setting!r}",
                          f"deepspeed.param_groups=auto (ZeRO-1/2: {AUTO_ZERO12}), or deepspeed.param_groups=1 for "
                          "one group per trained module")


def count(setting: object, zero_stage: int, resumed: dict | None = None) -> int:
    """How many groups to cut the trained parameters into. `auto`: a resumed ZeRO-1/2 checkpoint's own count
    (`resumed`: its meta.json; one that predates the setting had 1), else AUTO_ZERO12 at ZeRO-1/2 and 1 at other
    stages (ZeRO-3 partitions parameter by parameter, stage 0 flattens nothing)."""
    check(setting)
    if setting != AUTO:
        assert isinstance(setting, int)
        return setting
    if zero_stage not in (1, 2):
        return 1
    if resumed is not None and resumed.get("use_deepspeed") and resumed.get("zero_stage") in (1, 2):
        return int(resumed.get("param_groups", 1))
    return AUTO_ZERO12


def layout(module_numels: Sequence[Sequence[int]], groups: int) -> tuple[tuple[int, ...], ...]:
    """Per trained module, how many of its parameters (in order) each of its groups holds.

    `module_numels`: each trained module's trainable parameters' sizes, in parameters() order. The trained
    elements are cut at `groups` equal shares of their total: a parameter starting in share s goes to group s,
    and a module boundary always starts a new group (each module's group keeps its own learning rate). So there
    are at most groups + modules - 1 groups, each a contiguous run, none empty."""
    total = sum(sum(numels) for numels in module_numels)
    offset, out = 0, []
    for numels in module_numels:
        runs: list[int] = []
        share = None
        for numel in numels:
            here = min(groups - 1, offset * groups // total) if total else 0
            if here != share:
                runs.append(0)
                share = here
            runs[-1] += 1
            offset += numel
        out.append(tuple(runs))
    return tuple(out)


@dataclass(frozen=True)
class ParamGroups:
    """deepspeed.param_groups, resolved: K, and the groups it cuts (per trained module, each group's parameter
    count). A checkpoint's meta.json records both: ZeRO-1/2 load optimizer state group by group."""

    count: int
    layout: tuple[tuple[int, ...], ...]

    @classmethod
    def cut(cls, module_numels: Sequence[Sequence[int]], groups: int) -> ParamGroups:
        return cls(groups, layout(module_numels, groups))

    def sizes(self) -> list[int]:
        """The groups' parameter counts, module after module (what the planner's split_groups takes)."""
        return [n for module in self.layout for n in module]

    def as_meta(self) -> dict:
        return {"param_groups": self.count, "param_group_layout": [list(m) for m in self.layout]}

    @classmethod
    def from_meta(cls, meta: dict) -> ParamGroups | None:
        """A checkpoint's groups; None where it predates them (it had one group per trained module)."""
        if "param_group_layout" not in meta:
            return None
        return cls(int(meta["param_groups"]), tuple(tuple(m) for m in meta["param_group_layout"]))

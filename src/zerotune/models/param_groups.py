"""The optimizer's parameter groups: each trained module's parameters (the U-Net's, then each trained text
encoder's) cut into contiguous runs, `deepspeed.param_groups` of them in all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerotune.config.errors import ConfigError

AUTO = "auto"
# Why more than one: ZeRO-1/2 (DeepSpeed 0.19.8, stage_1_and_2.py DeepSpeedZeroOptimizer.__init__) flatten the groups
# one at a time. With one group the card holds its separate blocks, the flat buffer and the partition's clone at once
# (~3 copies of the trained weights); with K, about one copy plus 2/K (plan/zero12.py's `loading`). The update is the
# same for any K: Adam and its kin update element by element, and clipping takes one norm over all groups.
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
    """Per trained module, how many of its parameters (in order) each of its groups holds. `module_numels`: each
    trained module's trainable parameters' sizes, in parameters() order. A parameter starting in share s of
    `groups` equal shares of the elements goes to group s, and a module boundary always starts a new group (its
    own learning rate): at most groups + modules - 1 groups, each a contiguous run, none empty."""
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

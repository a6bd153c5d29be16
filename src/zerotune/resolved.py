"""A run, resolved once: everything a training process needs to know, frozen.

The job's parent (or rank 0, under torchrun / `accelerate launch` / `srun` without a zerotune parent) builds
it in preflight, from the composed config and the user's files, and writes it to the run directory once;
every worker reads it back and never folds a file or runs a check again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zerotune.checkpoints import ResumeDecision
from zerotune.compose.node import to_config
from zerotune.files import write_json_atomic
from zerotune.models import ModelStats, stats_from_json
from zerotune.models.param_groups import ParamGroups
from zerotune.platform import Platform
from zerotune.rundir.plan import Plan
from zerotune.schema import Config, as_dict

RESOLVED_FILE = "resolved.json"


@dataclass(frozen=True)
class ResolvedRun:
    config: Config                # the schema's frozen dataclasses, the user's files folded in
    ds_config: dict[str, Any]     # validated; what DeepSpeed (or the plain path) is given
    use_deepspeed: bool           # False: plain accelerate, stage 0 only
    model_stats: ModelStats
    input_shape: tuple[int, int, int]
    platform: Platform
    world_size: int
    config_sources: dict[str, Any] = field(default_factory=dict)  # where each value came from, config folders
    config_warnings: tuple[str, ...] = ()  # the DeepSpeed file's keys left out or translated
    resume: ResumeDecision | None = None  # the checkpoint to continue (checked), and how
    plan: Plan | None = None              # the planner's prediction (summary.json's "plan")
    # the optimizer zerotune builds and hands the engine ({"name", "class", "params"}); None: the dict's own
    client_optimizer: dict[str, Any] | None = None
    # the optimizer's parameter groups (deepspeed.param_groups, resolved); None: one group per trained module
    param_groups: ParamGroups | None = None

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage that runs: the DeepSpeed dict's; 0 on the plain accelerate path, whatever zero_stage says."""
        return int(self.ds_config["zero_optimization"]["stage"]) if self.use_deepspeed else 0

    def groups(self) -> ParamGroups:
        """The optimizer's parameter groups: as resolved, or one per trained module (a run resolved before them)."""
        return self.param_groups or ParamGroups.cut(self.model_stats.module_numels(), 1)

    def group_sizes(self) -> list[int]:
        """The groups' parameter counts, module after module (the planner's `groups`)."""
        return self.groups().sizes()

    def group_layout(self) -> tuple[tuple[int, ...], ...]:
        """Per trained module, its groups' parameter counts."""
        return self.groups().layout

    @property
    def nvme_dir(self) -> str | None:
        """The folder DeepSpeed swaps to, when offloading to NVMe."""
        offload = self.config.offload
        return offload.path if offload.device == "nvme" else None

    def to_json(self) -> dict[str, Any]:
        resume = None if self.resume is None else {**asdict(self.resume), "path": str(self.resume.path)}
        return {"config": as_dict(self.config), "ds_config": self.ds_config, "use_deepspeed": self.use_deepspeed,
                "model_stats": asdict(self.model_stats), "input_shape": list(self.input_shape),
                "platform": asdict(self.platform), "world_size": self.world_size,
                "config_sources": self.config_sources, "config_warnings": list(self.config_warnings),
                "resume": resume, "plan": None if self.plan is None else self.plan.to_dict(), "client_optimizer": self.client_optimizer,
                "param_groups": None if self.param_groups is None else asdict(self.param_groups)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResolvedRun:
        stats = data["model_stats"]
        resume = data["resume"]
        return cls(config=to_config(data["config"]), ds_config=data["ds_config"],
                   use_deepspeed=bool(data["use_deepspeed"]),
                   model_stats=stats_from_json(stats),
                   input_shape=tuple(data["input_shape"]),  # type: ignore[arg-type]
                   platform=Platform(**data["platform"]), world_size=int(data["world_size"]),
                   config_sources=data["config_sources"], config_warnings=tuple(data["config_warnings"]),
                   resume=None if resume is None else ResumeDecision(
                       path=Path(resume["path"]), mode=resume["mode"], meta=resume["meta"],
                       changed={k: tuple(v) for k, v in resume["changed"].items()}),
                   plan=Plan.from_dict(data["plan"]), client_optimizer=data["client_optimizer"],
                   param_groups=_groups(data.get("param_groups")))

    def save(self, run_dir: str | Path) -> None:
        write_json_atomic(Path(run_dir) / resolved_file(self.config.launch.node_rank), self.to_json())

    @classmethod
    def load(cls, run_dir: str | Path, node_rank: int = 0) -> ResolvedRun:
        return cls.from_json(json.loads((Path(run_dir) / resolved_file(node_rank)).read_text()))


def resolved_file(node_rank: int) -> str:
    """resolved.json; in a job of several nodes sharing the folder, node k's own (its launch block differs)."""
    return RESOLVED_FILE if node_rank == 0 else f"resolved.node{node_rank}.json"


def _groups(data: dict | None) -> ParamGroups | None:
    return None if data is None else ParamGroups(int(data["count"]), tuple(tuple(m) for m in data["layout"]))

"""The composed config as it will run: the user's DeepSpeed JSON and accelerate config folded in, then frozen
into the schema's dataclasses. Light on purpose (no torch, DeepSpeed or diffusers): a job's parent settles its
config before it starts its workers, and the checks that need those run while the workers import."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from zerotune import schema
from zerotune.schema import Config, launch_world_size
from zerotune.user_config import UserConfig, resolve

log = logging.getLogger("zerotune.preflight")


@dataclass(frozen=True)
class Settled:
    """The config with the user's files folded in, frozen: what a job starts its workers from (its launch
    block), before the checks that need DeepSpeed and the model."""

    config: Config
    user: UserConfig
    world_size: int


def _fit_default_warmup(draft: DictConfig, user: UserConfig) -> None:
    """A default warm-up longer than a short run (`train.max_steps=3`) is shortened to a tenth of the run;
    one typed on the command line or given by a file stays, and the scheduler check reports it."""
    steps, sched = draft.train.max_steps, draft.scheduler
    warmup = sched.warmup_steps
    if sched.name not in ("warmup_decay", "cosine") or warmup is None or int(warmup) < steps:
        return
    if user.origin_of("scheduler.warmup_steps") != "default":
        return
    fitted = max(steps // 10, 1) if steps > 1 else 0
    log.warning("scheduler.warmup_steps=%s does not fit train.max_steps=%s: using %s", warmup, steps, fitted)
    sched.warmup_steps = fitted
    if fitted == 0:
        sched.name = "constant"  # one step leaves nothing to warm up or decay over


def settle(cfg: DictConfig, overrides: list[str] | tuple = (), world_size: int | None = None,
           settings: Mapping[str, Any] | None = None, quiet: bool = False) -> Settled:
    """The composed config as it will run, frozen: the user's DeepSpeed JSON and accelerate config folded in
    (`overrides`, as typed on the command line, may not contradict them), then `settings` (what the job's
    surroundings fix: a SLURM job's nodes and ranks). `cfg` itself is left as it is. `world_size`: None means
    `launch.num_processes x launch.nnodes`. `quiet`: the file's warnings are recorded, not logged."""
    draft = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else schema.typed(cfg)
    for key, value in (settings or {}).items():
        OmegaConf.update(draft, key, value, merge=False)
    user = resolve(draft, overrides, world_size, quiet=quiet)
    _fit_default_warmup(draft, user)
    config = schema.to_config(draft)
    return Settled(config, user, world_size or launch_world_size(config.launch))

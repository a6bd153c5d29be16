"""The schema as conf/config.yaml's `zerotune_schema`, and the composed config as it will run: a file's value replaces
the group default, a typed value that contradicts a file (or two files that disagree) is an error, and the result is
frozen into `Config`, past which no DictConfig is seen. Light on purpose (no torch, DeepSpeed or diffusers): a job's
parent settles its config before it starts its workers."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from zerotune.config import accelerate_file, deepspeed_file, precedence
from zerotune.config.accelerate_file import Setting, from_accelerate, from_deepspeed, stated
from zerotune.config.deepspeed_blocks import Known, solve
from zerotune.config.errors import ConfigError
from zerotune.config.precedence import UserConfig, pinned_by, typed_keys
from zerotune.config.schema import Config, launch_world_size


def structured() -> DictConfig:
    """The schema as a config Hydra can compose into: the frozen dataclasses' read-only nodes made writable,
    as composition writes defaults, then overrides, into them."""
    node = OmegaConf.structured(Config)

    def writable(container: DictConfig) -> None:
        OmegaConf.set_readonly(container, None)
        for key in container:
            child = container._get_node(key)  # the node itself: reading it as a value would resolve it
            if isinstance(child, DictConfig):
                writable(child)

    writable(node)
    return node


def register() -> None:
    """Make `zerotune_schema` available to conf/config.yaml's defaults list."""
    ConfigStore.instance().store(name="zerotune_schema", node=structured())


def typed(cfg: DictConfig | Mapping[str, Any]) -> DictConfig:
    """A plain config (a run's config.yaml) with the schema's types again, still a DictConfig."""
    return OmegaConf.merge(structured(), cfg)  # type: ignore[return-value]


def to_config(cfg: DictConfig | Mapping[str, Any]) -> Config:
    """The composed config (Hydra's DictConfig, or plain data: a run's resolved.json) as the schema's frozen
    dataclasses: what every function past the command line is given. Interpolations are resolved here, once."""
    node = cfg if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is Config else typed(cfg)
    return OmegaConf.to_object(node)  # type: ignore[return-value]


log = logging.getLogger("zerotune.plan.resolve")


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


def _fit_text_tokens(draft: DictConfig, user: UserConfig) -> None:
    """data.max_sequence_length, T5's tokens per caption, sets the text condition's length: model.clip_tokens (SD3's
    CLIP tokens, ahead of T5's) plus these. Only a model conditioned through T5 (FLUX.1, SD3) takes it."""
    tokens = draft.data.max_sequence_length
    if tokens is None:
        return
    model = draft.model
    if model.conditioning != "text_pooled":
        raise ConfigError("data.max_sequence_length", f"sets T5's tokens per caption; model={model.name} has no T5 "
                          "encoder (its CLIP encoders take model.text_seq_len tokens)", "data.max_sequence_length=null")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= 512:
        raise ConfigError("data.max_sequence_length", f"must be a whole number of tokens from 1 to 512 (the "
                          f"pipelines' limit), got {tokens!r}", "data.max_sequence_length=512 (FLUX.1-dev's), or 256")
    length = int(model.clip_tokens) + tokens
    if "model.text_seq_len" in user.typed and int(model.text_seq_len) != length:
        raise ConfigError("model.text_seq_len", f"is {model.text_seq_len}, but data.max_sequence_length={tokens} "
                          f"makes the condition {length} tokens long (model.clip_tokens={model.clip_tokens} + {tokens})",
                          f"model.text_seq_len={length} (or no model.text_seq_len: data.max_sequence_length sets it)")
    model.text_seq_len = length


def settle(cfg: DictConfig, overrides: list[str] | tuple = (), world_size: int | None = None,
           settings: Mapping[str, Any] | None = None, quiet: bool = False) -> Settled:
    """The composed config as it will run, frozen: the user's files folded in (`overrides`, as typed, may not
    contradict them), then `settings` (a SLURM job's nodes and ranks). `cfg` is left as it is. `world_size`:
    None means `launch.num_processes x launch.nnodes`. `quiet`: the file's warnings are recorded, not logged."""
    draft = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else typed(cfg)
    for key, value in (settings or {}).items():
        OmegaConf.update(draft, key, value, merge=False)
    user = _fold_user_files(draft, overrides, world_size, quiet=quiet)
    _fit_default_warmup(draft, user)
    _fit_text_tokens(draft, user)
    config = to_config(draft)
    return Settled(config, user, world_size or launch_world_size(config.launch))


def _fold_user_files(cfg: DictConfig, overrides: list[str] | tuple = (), world_size: int | None = None,
                     environ: dict | None = None, quiet: bool = False) -> UserConfig:
    """Fold the user's accelerate config(s) and DeepSpeed JSON into `cfg` (settle's own copy) in place; return
    what was used."""
    user = UserConfig(typed=typed_keys(list(overrides)))
    applied: dict[str, Setting] = {}
    for acc in accelerate_file.find(cfg.accelerate.config_file, environ):
        user.accelerate.append({"origin": acc.origin, "how": acc.how, "path": acc.path})
        if acc.how == "default location":
            log.info("read accelerate's default config %s (accelerate.config_file=null to ignore it)", acc.path)
        for s in from_accelerate(acc, launched_externally=acc.how == "environment"):
            _apply(cfg, s, applied, user)
    path = cfg.deepspeed.config_file
    if path:
        user.deepspeed_path = str(Path(str(path)).expanduser())
        user.deepspeed, user.warnings = deepspeed_file.load(user.deepspeed_path, quiet=quiet)
        for s in from_deepspeed(user.deepspeed, Path(user.deepspeed_path).name):
            _apply(cfg, s, applied, user)
    # the batch: DeepSpeed's three keys, the command line and the defaults settled together
    world = launch_world_size(cfg.launch) if world_size is None else world_size
    ds = user.deepspeed or {}
    name = user._ds_name()

    def known(ds_key: str, cfg_key: str) -> Known | None:
        in_file = ds.get(ds_key)
        line = pinned_by(user.typed, cfg_key)
        typed_value = OmegaConf.select(cfg, cfg_key) if line else None
        if stated(in_file) and typed_value is not None and not _same(cfg_key, typed_value, in_file):
            raise ConfigError(ds_key, f"the command line says `{line}` but {name} says {ds_key}: {in_file}",
                              f"drop `{line}` from the command line, or change {ds_key} in {name}")
        if stated(in_file):
            return Known.read(in_file, f"{name}", ds_key, name)
        if line:
            return Known.read(typed_value, "command line", cfg_key)
        if cfg_key in user.origins:  # from an accelerate config
            return Known.read(OmegaConf.select(cfg, cfg_key), user.origins[cfg_key], cfg_key)
        return None

    micro = known("train_micro_batch_size_per_gpu", "train.batch_size")
    accum = known("gradient_accumulation_steps", "train.grad_accum")
    total_in_file = ds.get("train_batch_size")
    total = Known.read(total_in_file, f"{name}", "train_batch_size", name) if stated(total_in_file) else None
    defaults = (Known.read(OmegaConf.select(cfg, "train.batch_size"), "default", "train.batch_size"),
                Known.read(OmegaConf.select(cfg, "train.grad_accum"), "default", "train.grad_accum"))
    user.batch = solve(micro, accum, total, world, *defaults)
    procs = f"{world} process{'es' if world > 1 else ''}"

    def part_origin(part: Known | None, cfg_key: str) -> str:
        if part is not None:
            return part.origin
        if total is not None:
            return f"derived: train_batch_size / (the other factor x {procs})"
        return user.origin_of(cfg_key)

    user.batch_origins = {
        "train_batch_size": total.origin if total else f"derived: micro batch x accumulation x {procs}",
        "train_micro_batch_size_per_gpu": part_origin(micro, "train.batch_size"),
        "gradient_accumulation_steps": part_origin(accum, "train.grad_accum")}
    OmegaConf.update(cfg, "train.batch_size", user.batch.micro, merge=False)
    OmegaConf.update(cfg, "train.grad_accum", user.batch.accum, merge=False)
    return user


def _apply(cfg: DictConfig, s: Setting, applied: dict[str, Setting], user: UserConfig) -> None:
    if s.key == "precision.not":  # a file says "fp16.enabled: false"
        if cfg.precision.name != s.value:
            return
        s = Setting("precision.name", "fp32", s.origin)
    earlier = applied.get(s.key)
    if earlier is not None and not _same(s.key, earlier.value, s.value):
        raise ConfigError(s.key, f"{earlier.origin} says {earlier.value!r} but {s.origin} says {s.value!r}",
                          "make the two files agree (or drop one of them)")
    current = OmegaConf.select(cfg, s.key, default=None)
    line = pinned_by(user.typed, s.key)
    if line is not None and current != "auto" and not _same(s.key, current, s.value):
        raise ConfigError(s.key, f"the command line says `{line}` but {s.origin} says {s.value!r}",
                          f"drop `{line}` from the command line, or {precedence.change(s.origin)}")
    applied[s.key] = s
    user.origins[s.key] = s.origin
    if not _same(s.key, current, s.value):
        log.info("%s = %r, from %s", s.key, s.value, s.origin)
        OmegaConf.update(cfg, s.key, s.value, merge=False, force_add=True)


def _same(key: str, a: Any, b: Any) -> bool:
    if OmegaConf.is_config(a):
        a = OmegaConf.to_container(a, resolve=True)
    if key.endswith("path") or key.endswith("config_file"):
        return a is not None and b is not None and os.path.abspath(os.path.expanduser(str(a))) == \
            os.path.abspath(os.path.expanduser(str(b)))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(key, x, y) for x, y in zip(a, b, strict=True))
    return a == b

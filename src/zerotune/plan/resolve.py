"""Preflight: a settled config (config/compose/settle.py) checked once into a frozen ResolvedRun, written to the run
directory for every worker to read back. Every bad configuration stops here, before any model exists; every
"auto" of a user's DeepSpeed file is filled first (bucket sizes: DeepSpeed's defaults capped at the model's size;
accelerate's rule reads a hidden_size U-Nets lack)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zerotune import models
from zerotune.config import search
from zerotune.config.compose.settle import Settled, to_config
from zerotune.config.deepspeed_blocks import Batch, derived_params
from zerotune.config.errors import ConfigError
from zerotune.config.files import write_json_atomic
from zerotune.config.schema import Config, as_dict
from zerotune.data import check_data
from zerotune.data.prompts import check_validation
from zerotune.data.spec import DataSpec
from zerotune.host.platform import Platform, detect
from zerotune.models import (
    ModelStats,
    adapter,
    backbones,
    flow_matching,
    param_groups,
    stats_from_json,
    text_encoders,
)
from zerotune.models.param_groups import ParamGroups
from zerotune.plan import deepspeed
from zerotune.plan.deepspeed import DEFAULT_BUCKETS, bucket_size, optimizer_block
from zerotune.rundir import checkpoints
from zerotune.rundir import resume as rundir_resume
from zerotune.rundir.loggers import check_logger
from zerotune.rundir.plan import Plan
from zerotune.rundir.resume import ResumeDecision

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


AUTO = "auto"


def fill(ds: dict, cfg: Config, stats: ModelStats, batch: Batch, source: str) -> dict:
    """`ds` with every "auto" replaced (one with no value is a ConfigError); `source` names the file in errors."""
    ds = _filled(ds, {"train_batch_size": batch.total, "train_micro_batch_size_per_gpu": batch.micro,
                      "gradient_accumulation_steps": batch.accum, "gradient_clipping": cfg.train.grad_clip})
    for name in ("fp16", "bf16"):
        if isinstance(ds.get(name), dict):
            ds[name] = _filled(ds[name], {"enabled": cfg.precision.name == name})
    if isinstance(ds.get("zero_optimization"), dict):
        knobs = cfg.deepspeed
        values = {"stage": cfg.zero_stage.stage,
                  "stage3_param_persistence_threshold": int(knobs.stage3_param_persistence_threshold),
                  "stage3_gather_16bit_weights_on_model_save":
                      bool(knobs.stage3_gather_16bit_weights_on_model_save),
                  **{key: bucket_size(knobs, key, stats) for key in DEFAULT_BUCKETS}}
        ds["zero_optimization"] = _filled(ds["zero_optimization"], values)
    if isinstance(ds.get("optimizer"), dict):
        ds["optimizer"] = _params(ds["optimizer"], optimizer_block(cfg.optimizer)["params"])
    if isinstance(ds.get("scheduler"), dict):
        values = derived_params(cfg.scheduler, text_encoders.group_lrs(cfg.model, cfg.optimizer.lr),
                                cfg.train.max_steps)
        ds["scheduler"] = _params(ds["scheduler"], values)
    _refuse_leftovers(ds, "", source)
    return ds


def _filled(block: dict, values: dict) -> dict:
    return {key: values[key] if value == AUTO and key in values else value for key, value in block.items()}


def _params(block: dict, values: dict) -> dict:
    return {**block, "params": _filled(block.get("params") or {}, values)}


def _refuse_leftovers(node: Any, path: str, source: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_leftovers(value, f"{path}.{key}" if path else key, source)
    elif node == AUTO:
        raise ConfigError(path, f"\"auto\" in {source}, and zerotune has no setting to fill it from",
                          f"write a value for {path} in {source}")


def merge(generated: dict, user: dict) -> dict:
    """The user's top-level values and blocks, whole (mixing ours in changes their meaning: a WarmupLR gaining
    total_num_steps); in zero_optimization the user's keys and offload blocks win, ours fill the rest."""
    out = dict(generated)
    for key, value in user.items():
        if key == "zero_optimization" and isinstance(value, dict) and isinstance(out.get(key), dict):
            zero = {k: v for k, v in out[key].items() if not k.startswith("offload_")} \
                if any(k.startswith("offload_") for k in value) else dict(out[key])
            zero.update(value)
            out[key] = zero
        else:
            out[key] = value
    return out


log = logging.getLogger(__name__)

SEED_MAX = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)


def _use_deepspeed(cfg: Config, platform: Platform) -> bool:
    setting = cfg.deepspeed.enabled
    if setting == "auto":
        return platform.deepspeed_supported
    if setting is True and not platform.deepspeed_supported:
        raise ConfigError("deepspeed.enabled", f"DeepSpeed was asked for, but {platform.deepspeed_reason}",
                          "deepspeed.enabled=auto with zero_stage=0 (plain accelerate)")
    if setting is False and cfg.zero_stage.stage != 0:
        raise ConfigError("deepspeed.enabled", f"ZeRO stage {cfg.zero_stage.stage} needs DeepSpeed",
                          "deepspeed.enabled=auto, or zero_stage=0")
    if setting not in (True, False):
        raise ConfigError("deepspeed.enabled", f"must be auto, true or false, got {setting!r}",
                          "deepspeed.enabled=auto")
    return bool(setting)


def _check_train(cfg: Config) -> None:
    """What the DeepSpeed dict does not carry (its batch and clipping values are checked once, there)."""
    value = cfg.train.max_steps
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("train.max_steps", f"must be a positive integer, got {value!r}", "train.max_steps=1 or more")
    seed = cfg.train.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ConfigError("train.seed", f"must be an integer from 0 to 2**32 - 1 (numpy's seed range), "
                          f"got {seed!r}", "train.seed=0, or any integer in that range")
    if cfg.diffusion.prediction_type not in ("epsilon", "v_prediction", "flow_matching"):
        raise ConfigError("diffusion.prediction_type", f"unknown {cfg.diffusion.prediction_type!r}",
                          "diffusion.prediction_type=epsilon or v_prediction (U-Nets), flow_matching (FLUX.1, SD3)")
    flow_matching.check(cfg.diffusion)  # first: a DDPM-only setting on a flow model is named as such
    _check_loss_settings(cfg)
    text_encoders.check(cfg.model)
    _check_transformer(cfg)


def _check_transformer(cfg: Config) -> None:
    """What a diffusion transformer (FLUX.1, SD3) does not take: its T5 and CLIP encoders stay frozen."""
    model = cfg.model
    if not backbones.is_transformer(model):
        return
    if model.attention != "default":  # models/__init__.py build_network's sdpa processor is a U-Net's
        raise ConfigError("model.attention", f"model={model.name}'s attention processors already call torch's "
                          "scaled_dot_product_attention", "model.attention=default")
    if text_encoders.trained(model):
        raise ConfigError("model.train_text_encoder", f"model={model.name}'s text encoders (T5, CLIP) are frozen: "
                          "their outputs are cached with the latents", "model.train_text_encoder=none")
    if model.text_seq_len <= model.clip_tokens:
        raise ConfigError("model.text_seq_len", f"is {model.text_seq_len}, which leaves T5 no token after CLIP's "
                          f"{model.clip_tokens} (model.clip_tokens)",
                          f"model.text_seq_len={model.clip_tokens + 256} (T5's 256 after CLIP's)")


def _check_loss_settings(cfg: Config) -> None:
    """The loss settings SDXL recipes use (noise offset, Min-SNR-γ, a timestep range, zero terminal SNR)."""
    diff = cfg.diffusion
    offset = diff.noise_offset
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not 0 <= offset < 1:
        raise ConfigError("diffusion.noise_offset", f"must be a number from 0 (off) up to 1, got {offset!r}",
                          "diffusion.noise_offset=0.05 (SDXL recipes use 0.05 to 0.1), or "
                          "diffusion.noise_offset=0 to turn it off")
    gamma = diff.min_snr_gamma
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or gamma <= 0):
        raise ConfigError("diffusion.min_snr_gamma", f"must be a positive number or null, got {gamma!r}",
                          "diffusion.min_snr_gamma=5 (the paper's), or diffusion.min_snr_gamma=null to turn it off")
    steps = diff.num_train_timesteps
    window = diff.timestep_range
    if window is not None:
        if (len(window) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in window)
                or not 0 <= window[0] <= window[1] < steps):
            raise ConfigError("diffusion.timestep_range", f"must be [first, last] with 0 <= first <= last < "
                              f"{steps} (diffusion.num_train_timesteps), got {list(window)!r}",
                              f"diffusion.timestep_range=[0,{steps // 2 - 1}] (the less noisy half), or "
                              "diffusion.timestep_range=null for all of them")
    if diff.rescale_betas_zero_snr and diff.prediction_type != "v_prediction":
        raise ConfigError("diffusion.rescale_betas_zero_snr", "zero terminal SNR needs a v-prediction model: at "
                          "the last timestep the image is pure noise, so an epsilon model predicts nothing and "
                          "sampling divides by 0 (Lin et al. 2023, section 3.2)",
                          "model.prediction_type=v_prediction, or diffusion.rescale_betas_zero_snr=false")


def _check_inputs(cfg: Config, training: bool) -> None:
    """The weights, data and logger a worker would open: what would fail there (after its start-up) fails here."""
    models.check_pretrained(cfg.model)
    check_data(DataSpec.from_config(cfg), training)
    check_validation(cfg)
    check_logger(cfg.logger)


def check(settled: Settled, platform: Platform | None = None, run_dir: str | Path | None = None) -> ResolvedRun:
    """The settled config checked, with its DeepSpeed dict. With the job's `run_dir` (a job that will train), the
    checkpoint `resume` names is checked and judged too, and the data set against the model."""
    cfg, user, world_size = settled.config, settled.user, settled.world_size
    platform = platform or detect()
    try:
        _check_train(cfg)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    shape = models.latent_shape(cfg.model, cfg.resolution.size)
    _check_inputs(cfg, training=run_dir is not None)
    use_ds = _use_deepspeed(cfg, platform)
    stats = models.model_stats(cfg.model, cfg.adapter)
    try:
        ds = deepspeed.build(cfg, world_size, stats, given=set(user.deepspeed or ()))
        if user.deepspeed is not None:
            assert user.batch is not None and user.deepspeed_path is not None  # settled with the file
            ds = fill(merge(ds, user.deepspeed), cfg, stats, user.batch, user.deepspeed_path)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    deepspeed.choose_adam(ds, cfg)
    try:
        client = deepspeed.client_optimizer(cfg.optimizer)
    except ConfigError as exc:
        raise user.attribute(exc) from None
    adapter.check_optimizer(cfg.adapter, ds["optimizer"]["type"] if client is None else client["name"])
    try:
        ds = deepspeed.validate(ds, platform, world_size, client)
    except ConfigError as exc:
        raise user.attribute(exc) from None  # named where the user set it: a file's key or zerotune's
    path = None if run_dir is None else checkpoints.resolve_resume(cfg.resume, cfg.checkpoint.dir, Path(run_dir))
    try:
        count = param_groups.count(cfg.deepspeed.param_groups, int(ds["zero_optimization"]["stage"]) if use_ds else 0,
                                   None if path is None else checkpoints.read_meta(path))
    except ConfigError as exc:
        raise user.attribute(exc) from None
    groups = ParamGroups.cut(stats.module_numels(), count)
    resume = None
    if path is not None:
        now = rundir_resume.current_meta(cfg, ds, use_ds, world_size, client, groups)
        resume = rundir_resume.decide_resume(path, now, ds)
    return ResolvedRun(config=cfg, ds_config=ds, use_deepspeed=use_ds, model_stats=stats, input_shape=shape,
                       platform=platform, world_size=world_size, client_optimizer=client, param_groups=groups,
                       config_sources={**user.summary(ds), "configs": search.current().describe()},
                       config_warnings=tuple(user.warnings), resume=resume)

"""Configs users already have (a DeepSpeed JSON, an accelerate YAML, `accelerate launch`'s environment) as settings
in zerotune's keys: `zero_optimization.stage: 3` is `zero_stage.stage=3`. Only values a file states count: a missing
key or `"auto"` leaves the choice to zerotune's groups. config/compose/settle.py applies them."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotune.config.deepspeed_blocks import TYPES, normalize
from zerotune.config.errors import ConfigError

KEY = "accelerate.config_file"

# What `accelerate launch` exports for each DeepSpeed field (accelerate/utils/launch.py).
ENV_FIELDS = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
}
# accelerate's DeepSpeedPlugin refuses a config dict while this names fields of an accelerate config file.
DS_FIELDS_ENV = "ACCELERATE_CONFIG_DS_FIELDS"


@dataclass
class AccelerateConfig:
    origin: str                                   # shown in messages: the file, or "accelerate launch"
    how: str                                      # "accelerate.config_file" | "default location" | "environment"
    path: str | None = None
    distributed_type: str | None = None
    mixed_precision: str | None = None
    deepspeed: dict = field(default_factory=dict)  # the deepspeed_config section
    machines: dict = field(default_factory=dict)   # num_processes, num_machines, machine_rank, main_process_*


def default_location() -> Path:
    """Where `accelerate config` saves: $HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface,
    then accelerate/default_config.yaml."""
    # accelerate's rule (accelerate/commands/config/config_args.py) written out: importing that module imports
    # torch, 1.6 s that every config error would wait for. tests/test_user_configs.py compares the two.
    cache = os.environ.get("XDG_CACHE_HOME", "~/.cache")
    home = os.path.expanduser(os.environ.get("HF_HOME", os.path.join(cache, "huggingface")))
    return Path(home) / "accelerate" / "default_config.yaml"


def from_file(path: str | Path, how: str) -> AccelerateConfig:
    """Parse with accelerate's own loader, so a file accelerate refuses is refused here, in our words."""
    from accelerate.commands.config.config_args import load_config_from_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(KEY, f"{file} does not exist", "point accelerate.config_file at the YAML `accelerate "
                          "config` wrote, or accelerate.config_file=null")
    try:
        cfg = load_config_from_file(str(file)).to_dict()
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(KEY, f"accelerate cannot read {file}: {exc}",
                          "fix the file (or regenerate it with `accelerate config`)") from None
    except Exception as exc:  # yaml's scanner and parser errors
        raise ConfigError(KEY, f"{file} is not valid YAML: {exc}".replace("\n", " "),
                          "fix the YAML at that position") from None
    machines = {k: cfg[k] for k in ("num_processes", "num_machines", "machine_rank", "main_process_ip",
                                    "main_process_port") if cfg.get(k) is not None}
    return AccelerateConfig(origin=file.name, how=how, path=str(file),
                            distributed_type=str(cfg.get("distributed_type") or "NO").upper(),
                            mixed_precision=cfg.get("mixed_precision"),
                            deepspeed=dict(cfg.get("deepspeed_config") or {}), machines=machines)


def find(setting: str | None, environ: dict | None = None) -> list[AccelerateConfig]:
    """The accelerate configs in force: `accelerate launch`'s environment, and the file `setting` names
    (`auto`: accelerate's default location when no `accelerate launch` is around and the file exists)."""
    env = os.environ if environ is None else environ
    found = []
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":  # started by `accelerate launch`
        deepspeed = {name: env[var] for name, var in ENV_FIELDS.items() if var in env}
        # ACCELERATE_MIXED_PRECISION is always set ("no" by default); it states an intent only when the config
        # file gave it (then it is listed among the fields) or when it asks for a mixed precision.
        listed = {f.strip() for f in env.get(DS_FIELDS_ENV, "").split(",") if f.strip()}
        mixed = env.get("ACCELERATE_MIXED_PRECISION")
        if mixed == "no" and "mixed_precision" not in listed:
            mixed = None
        found.append(AccelerateConfig(origin="accelerate launch", how="environment", distributed_type="DEEPSPEED",
                                      mixed_precision=mixed, deepspeed=deepspeed))
    text = "" if setting is None else str(setting)
    default = default_location()
    if text == "auto" and not found and default.is_file():
        found.append(from_file(default, "default location"))
    elif text not in ("auto", "", "null", "none", "None"):
        found.append(from_file(text, KEY))
    return found


@contextlib.contextmanager
def absorbed_launch_environment():
    """`accelerate launch`'s variables hidden while accelerate's DeepSpeedPlugin is built: zerotune has already
    folded them into the dict (or refused a conflict), and the plugin would refuse the dict."""
    names = [DS_FIELDS_ENV, "ACCELERATE_MIXED_PRECISION", *ENV_FIELDS.values()]
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


log = logging.getLogger(__name__)

AUTO = "auto"

# zerotune's scheduler option names, by DeepSpeed's scheduler types.
SCHEDULER_NAMES = {kind: name for name, kind in TYPES.items()}
# Optimizer params that zerotune's optimizer groups also carry.
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")
# zero_optimization keys that zerotune's `deepspeed.*` knobs set.
ZERO_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
              "stage3_param_persistence_threshold", "overlap_comm", "contiguous_gradients",
              "stage3_gather_16bit_weights_on_model_save")
DEVICE_DEPTH = {"none": 0, "cpu": 1, "nvme": 2}


@dataclass(frozen=True)
class Setting:
    key: str        # zerotune's key, e.g. "zero_stage.stage"
    value: Any
    origin: str     # where the user wrote it, e.g. "ds_z3.json: zero_optimization.stage"


def stated(value: Any) -> bool:
    return value is not None and value != AUTO


def from_deepspeed(ds: dict, name: str) -> list[Setting]:
    """Settings a DeepSpeed dict states (batch keys are settled by `batch`, not here)."""
    out: list[Setting] = []

    def add(key: str, value: Any, where: str) -> None:
        if stated(value):
            out.append(Setting(key, value, f"{name}: {where}"))

    add("train.grad_clip", ds.get("gradient_clipping"), "gradient_clipping")
    zero = ds.get("zero_optimization") or {}
    add("zero_stage.stage", zero.get("stage"), "zero_optimization.stage")
    for knob in ZERO_KNOBS:
        add(f"deepspeed.{knob}", zero.get(knob), f"zero_optimization.{knob}")
    out += _offload(zero, name)
    out += _precision(ds, name)
    opt = ds.get("optimizer")
    if isinstance(opt, dict) and stated(opt.get("type")):
        add("optimizer.name", normalize(opt["type"], key="optimizer.type"), "optimizer.type")
        params = opt.get("params") or {}
        for param in OPTIMIZER_PARAMS:
            value = params.get(param)
            add(f"optimizer.{param}", list(value) if isinstance(value, (list, tuple)) else value,
                f"optimizer.params.{param}")
    sched = ds.get("scheduler")
    if isinstance(sched, dict) and stated(sched.get("type")):
        add("scheduler.name", SCHEDULER_NAMES.get(sched["type"], sched["type"]), "scheduler.type")
        params = sched.get("params") or {}
        if sched["type"] in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            add("scheduler.warmup_steps", params.get("warmup_num_steps"), "scheduler.params.warmup_num_steps")
    return out


def _offload(zero: dict, name: str) -> list[Setting]:
    """A file that gives either offload block defines offload whole: an absent one means DeepSpeed's default,
    none. A file that gives neither leaves offload to zerotune's `offload` group."""
    opt, param = zero.get("offload_optimizer"), zero.get("offload_param")
    if opt is None and param is None:
        return []
    opt_dev = str((opt or {}).get("device", "none")).lower()
    param_dev = str((param or {}).get("device", "none")).lower()
    for block, dev in (("offload_optimizer", opt_dev), ("offload_param", param_dev)):
        if dev not in DEVICE_DEPTH:
            raise ConfigError(f"zero_optimization.{block}.device", f"unknown offload device {dev!r} ({name})",
                              "use \"none\", \"cpu\" or \"nvme\"")
    where = f"{name}: zero_optimization.offload_*"
    device = max(opt_dev, param_dev, key=DEVICE_DEPTH.__getitem__)  # the deepest tier decides what is measured
    out = [Setting("offload.device", device, where), Setting("offload.params", param_dev != "none", where)]
    paths = {b.get("nvme_path") for b in (opt or {}, param or {}) if b.get("device") == "nvme"}
    paths.discard(None)
    if len(paths) == 1:
        out.append(Setting("offload.path", str(paths.pop()), f"{name}: zero_optimization.offload_*.nvme_path"))
    return out


def _precision(ds: dict, name: str) -> list[Setting]:
    on = {p for p in ("fp16", "bf16") if isinstance(ds.get(p), dict) and ds[p].get("enabled") is True}
    off = {p for p in ("fp16", "bf16") if isinstance(ds.get(p), dict) and ds[p].get("enabled") is False}
    if on == {"fp16", "bf16"}:
        raise ConfigError("bf16.enabled", f"bf16 and fp16 are both enabled ({name})",
                          "enable one of them in the file, or set both to \"auto\" and choose with precision=")
    if on:
        p = on.pop()
        return [Setting("precision.name", p, f"{name}: {p}.enabled")]
    if off == {"fp16", "bf16"}:
        return [Setting("precision.name", "fp32", f"{name}: fp16.enabled and bf16.enabled")]
    # One block explicitly off says "not that one"; precedence turns it into fp32 if that one was chosen.
    return [Setting("precision.not", p, f"{name}: {p}.enabled") for p in sorted(off)]


def from_accelerate(acc: AccelerateConfig, launched_externally: bool) -> list[Setting]:
    """accelerate's fields in zerotune's keys (the mapping accelerate's DeepSpeedPlugin applies itself)."""
    out: list[Setting] = []

    def add(key: str, value: Any, field: str) -> None:
        if stated(value):
            out.append(Setting(key, value, f"{acc.origin}: {field}"))

    kind = acc.distributed_type or "NO"
    if kind in ("FSDP", "XLA", "MEGATRON_LM", "TP"):
        raise ConfigError("accelerate.config_file", f"{acc.origin} asks for distributed_type {kind}; zerotune "
                          "trains with DeepSpeed", "set distributed_type: DEEPSPEED (or run `accelerate config` "
                          "again), or accelerate.config_file=null")
    if acc.mixed_precision is not None:
        precision = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(str(acc.mixed_precision).lower())
        if precision is None:
            raise ConfigError("precision", f"{acc.origin}: mixed_precision {acc.mixed_precision!r} is not "
                              "supported by zerotune", "mixed_precision: bf16, fp16 or no")
        add("precision.name", precision, "mixed_precision")
    ds = acc.deepspeed if kind == "DEEPSPEED" else {}
    if stated(ds.get("deepspeed_config_file")) and ds["deepspeed_config_file"] != "none":
        add("deepspeed.config_file", _beside(str(ds["deepspeed_config_file"]), acc.path),
            "deepspeed_config.deepspeed_config_file")
    add("zero_stage.stage", _int(ds.get("zero_stage"), acc, "zero_stage"), "deepspeed_config.zero_stage")
    add("train.grad_accum", _int(ds.get("gradient_accumulation_steps"), acc, "gradient_accumulation_steps"),
        "deepspeed_config.gradient_accumulation_steps")
    clip = ds.get("gradient_clipping")
    add("train.grad_clip", None if clip in (None, "auto", "none") else float(clip), "deepspeed_config.gradient_clipping")
    opt_dev = str(ds.get("offload_optimizer_device") or "").lower() or None
    param_dev = str(ds.get("offload_param_device") or "").lower() or None
    if opt_dev or param_dev:
        device = max(opt_dev or "none", param_dev or "none", key=lambda d: DEVICE_DEPTH.get(d, -1))
        add("offload.device", device, "deepspeed_config.offload_*_device")
        add("offload.params", (param_dev or "none") != "none", "deepspeed_config.offload_param_device")
    for path_field in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
        if ds.get(path_field) not in (None, "none"):
            add("offload.path", str(ds[path_field]), f"deepspeed_config.{path_field}")
    save16 = ds.get("zero3_save_16bit_model")
    if save16 is not None:
        add("deepspeed.stage3_gather_16bit_weights_on_model_save", _bool(save16),
            "deepspeed_config.zero3_save_16bit_model")
    if _bool(ds.get("zero3_init_flag", False)):
        # accelerate applies zero3_init_flag only to transformers' from_pretrained; a diffusers U-Net is built
        # whole either way and partitioned when DeepSpeed's engine takes it.
        log.warning("%s: zero3_init_flag has no effect on a diffusers U-Net (built whole, then partitioned)",
                    acc.origin)
    if launched_externally:  # under `accelerate launch` the launcher has already placed the processes
        return out
    m = acc.machines
    nodes = int(m.get("num_machines") or 1)
    if "num_processes" in m:
        total = int(m["num_processes"])
        if total % nodes:
            raise ConfigError("launch.num_processes", f"{acc.origin}: num_processes {total} is not divisible by "
                              f"num_machines {nodes}", "num_processes is the total over all machines")
        # accelerate counts processes over all machines; zerotune's launch.num_processes is per node.
        out.append(Setting("launch.num_processes", total // nodes, f"{acc.origin}: num_processes / num_machines"))
    for key, name in (("launch.nnodes", "num_machines"), ("launch.node_rank", "machine_rank"),
                      ("launch.master_addr", "main_process_ip"), ("launch.master_port", "main_process_port")):
        if m.get(name) is not None:
            out.append(Setting(key, m[name], f"{acc.origin}: {name}"))
    return out


def _beside(path: str, config_path: str | None) -> str:
    """accelerate reads a relative deepspeed_config_file from the working directory; where nothing is there,
    the file beside the YAML is what its author meant."""
    file = Path(path).expanduser()
    if file.is_absolute() or file.exists() or config_path is None:
        return str(file.absolute()) if file.exists() else path
    beside = Path(config_path).parent / file
    return str(beside) if beside.exists() else path


def _int(value: Any, acc: AccelerateConfig, name: str) -> int | None:
    if value in (None, "auto", "none"):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"deepspeed_config.{name}", f"{acc.origin}: {name} must be an integer, got {value!r}",
                          f"set {name} to a whole number") from None


def _bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() == "true"

"""accelerate's own configs: the YAML `accelerate config` writes, and the environment `accelerate launch` sets.

Both are read into one shape, accelerate's field names (`zero_stage`, `offload_optimizer_device`,
`mixed_precision`, `num_processes`, ...), which `settings.from_accelerate` maps onto zerotune's keys.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from zerotune.errors import ConfigError

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
    """accelerate's DeepSpeedPlugin re-reads `accelerate launch`'s variables and refuses a config dict while
    ACCELERATE_CONFIG_DS_FIELDS names any. zerotune has already folded them into the dict (or refused a
    conflict), so they are hidden while the plugin is built."""
    names = [DS_FIELDS_ENV, "ACCELERATE_MIXED_PRECISION", *ENV_FIELDS.values()]
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)

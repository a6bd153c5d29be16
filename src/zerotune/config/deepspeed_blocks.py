"""The DeepSpeed dict's blocks, built from the config groups and checked before anything runs: the batch rule
(train_batch_size = micro batch × accumulation × world size), optimizers (DeepSpeed's own, and client optimizers
zerotune builds and hands to the engine) and the scheduler block."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Scheduler


@dataclass(frozen=True)
class Known:
    """One of the three batch values, where it came from, and how to change it there (an inconsistent triple
    is reported with the knob that keeps the user's global batch)."""

    value: int
    origin: str              # "ds.json", "command line" or "default"
    key: str                 # where to change it: "train.grad_accum", or the DeepSpeed key in the file
    file: str | None = None  # the file that holds `key`, when it came from one

    def __post_init__(self) -> None:
        _positive_int(self.value, self.key, self.file)

    @classmethod
    def read(cls, value: object, origin: str, key: str, file: str | None = None) -> Known:
        """A value as a DeepSpeed dict or the config states it (anything), refused unless a positive integer."""
        return cls(_positive_int(value, key, file), origin, key, file)

    def change(self, value: int | str) -> str:
        return _change(self.key, self.file, value)


def _positive_int(value: object, key: str, file: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where = f" ({file})" if file else ""
        raise ConfigError(key, f"must be a positive integer, got {value!r}{where}",
                          _change(key, file, "1 or more" if file is None else "a whole number, or \"auto\""))
    return value


def _change(key: str, file: str | None, value: int | str) -> str:
    return f"{key}={value}" if file is None else f"set {key} to {value} in {file}"


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    total: int


def solve(micro: Known | None, accum: Known | None, total: Known | None, world: int,
          default_micro: Known, default_accum: Known) -> Batch:
    """Fill in what is missing; with fewer than two known, zerotune's defaults supply the rest."""
    if total is None:
        micro = default_micro if micro is None else micro
        accum = default_accum if accum is None else accum
        return Batch(micro.value, accum.value, micro.value * accum.value * world)
    if micro is None:
        accum = default_accum if accum is None else accum
        return Batch(_divide(total, accum, world, "train_micro_batch_size_per_gpu"), accum.value, total.value)
    if accum is None:
        return Batch(micro.value, _divide(total, micro, world, "gradient_accumulation_steps"), total.value)
    if micro.value * accum.value * world != total.value:
        # Prefer changing the accumulation, then the micro batch: both keep the global batch the user asked for.
        keeps = f" (keeps train_batch_size {total.value})"
        if total.value % (micro.value * world) == 0:
            fix = accum.change(total.value // (micro.value * world)) + keeps
        elif total.value % (accum.value * world) == 0:
            fix = micro.change(total.value // (accum.value * world)) + keeps
        else:
            fix = f"{total.change(micro.value * accum.value * world)}, or set it to \"auto\""
        raise ConfigError("train_batch_size", f"{total.value} ({total.origin}) != micro batch {micro.value} "
                          f"({micro.origin}) x gradient accumulation {accum.value} ({accum.origin}) x {world} "
                          f"process{'es' if world > 1 else ''}", fix)
    return Batch(micro.value, accum.value, total.value)


def _divide(total: Known, other: Known, world: int, missing: str) -> int:
    value, rest = divmod(total.value, other.value * world)
    if rest or value < 1:
        raise ConfigError("train_batch_size", f"{total.value} ({total.origin}) is not a multiple of "
                          f"{other.value} ({other.origin}) x {world} process{'es' if world > 1 else ''}, so "
                          f"{missing} has no whole value", f"change {total.key} or {other.key}"
                          f"{f' in {total.file}' if total.file else ''}")
    return value


log = logging.getLogger(__name__)

# Canonical lower-case name -> DeepSpeed's "optimizer.type" spelling.
DEEPSPEED_TYPES = {
    "adamw": "AdamW",
    "adam": "Adam",
    "adagrad": "Adagrad",
    "lamb": "Lamb",
    "lion": "Lion",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}



@dataclass(frozen=True)
class ClientClass:
    path: str                       # module.Class
    keys: tuple[str, ...]           # the optimizer group's keys its constructor takes
    fixed: tuple[tuple[str, Any], ...] = ()   # constructor arguments zerotune sets itself, and why (below)
    package: str = ""               # what to pip install when the module is missing


# Client optimizers: the classes other tools train SDXL with, under zerotune's option names.
CLIENT_CLASSES = {
    # kohya's and SimpleTuner's Adafactor: the lr comes from the scheduler (relative_step=False), so the
    # DeepSpeed scheduler's warm-up and decay apply as to every other optimizer here.
    "adafactor": ClientClass("transformers.optimization.Adafactor",
                             ("lr", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter"),
                             (("relative_step", False), ("warmup_init", False)), "transformers"),
    "adamw8bit": ClientClass("bitsandbytes.optim.AdamW8bit", ("lr", "betas", "eps", "weight_decay"),
                             package="bitsandbytes"),
    "torch_adamw": ClientClass("torch.optim.AdamW", ("lr", "betas", "eps", "weight_decay")),
    "sgd": ClientClass("torch.optim.SGD", ("lr", "momentum", "weight_decay", "nesterov")),
}

# Names people write that mean an implementation of AdamW, not a different optimizer.
ADAMW_ALIASES = {"cpuadam", "fusedadam", "deepspeedcpuadam", "adam_w", "adamw_torch"}

# Named by DeepSpeed's docs but not built from a config dict by DeepSpeed 0.19's engine.
NOT_CONFIG_DRIVEN = {
    "onebitadam": "1-bit Adam",
    "onebitlamb": "1-bit LAMB",
    "zerooneadam": "0/1 Adam",
    "muon": "Muon (needs every parameter tagged use_muon by the model code)",
}


def _canon(name: str) -> str:
    return str(name).strip().lower().replace("-", "").replace(" ", "")


def is_known(name: str) -> bool:
    """A name DeepSpeed has (in any case or spelling normalize takes), or one it documents but cannot run."""
    canon = _canon(name)
    return canon in ADAMW_ALIASES or canon in DEEPSPEED_TYPES or canon in NOT_CONFIG_DRIVEN


def is_client(name: str) -> bool:
    """An optimizer zerotune builds and gives DeepSpeed, rather than one DeepSpeed builds from its dict."""
    return _canon(name) in CLIENT_CLASSES


def _choices() -> str:
    return ", ".join([*DEEPSPEED_TYPES, *CLIENT_CLASSES])


def normalize(name: str, key: str = "optimizer.name") -> str:
    """Return the canonical name for `name`, case-insensitively; AdamW aliases fall back with a warning."""
    canon = _canon(name)
    if canon in ADAMW_ALIASES:
        log.warning("optimizer %r is an AdamW implementation, not an optimizer choice: using DeepSpeed's AdamW "
                    "(CPU Adam when offloaded, fused Adam otherwise)", name)
        return "adamw"
    if canon in DEEPSPEED_TYPES or canon in CLIENT_CLASSES:
        return canon
    if canon in NOT_CONFIG_DRIVEN:
        raise ConfigError(key, f"{NOT_CONFIG_DRIVEN[canon]} is not available through a DeepSpeed config dict "
                          "in DeepSpeed 0.19", f"choose one of: {_choices()}")
    raise ConfigError(key, f"unknown optimizer {name!r}", f"choose one of: {_choices()} (case-insensitive)")


def _op_available(builder_name: str, device_type: str) -> bool:
    if device_type == "cuda":
        return True  # DeepSpeed's CUDA accelerator has every fused optimizer (built with nvcc on first use)
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().get_op_builder(builder_name)
    return builder is not None and builder.__name__ != "NotImplementedBuilder"


def check_supported(name: str, offloaded: bool, key: str = "optimizer.name", device_type: str = "cpu") -> None:
    """Refuse an optimizer that DeepSpeed cannot run on this accelerator with this offload choice."""
    if name in ("muadam", "muadamw", "musgd") and importlib.util.find_spec("mup") is None:
        raise ConfigError(key, f"{name} needs the `mup` package, which is not installed", "pip install mup")
    if name == "lamb":
        if offloaded:
            raise ConfigError(key, "DeepSpeed has no offloaded LAMB", "use offload=none, or optimizer=adamw")
        if not _op_available("FusedLambBuilder", device_type):
            raise ConfigError(key, "LAMB needs DeepSpeed's FusedLamb kernel, which this accelerator lacks",
                              "use optimizer=adamw (or lion with offload=cpu)")
    if name == "lion" and not offloaded and not _op_available("FusedLionBuilder", device_type):
        raise ConfigError(key, "Lion without offload needs DeepSpeed's FusedLion kernel, which this "
                          "accelerator lacks", "add offload=cpu (CPU Lion), or use optimizer=adamw")


def _implementation(name: str, offloaded: bool, torch_adam: bool):
    """The class DeepSpeed 0.19's engine builds for this optimizer (engine._configure_basic_optimizer)."""
    import torch

    if name in ("adam", "adamw"):
        if torch_adam:
            return torch.optim.AdamW
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        return DeepSpeedCPUAdam if offloaded else FusedAdam
    if name == "adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad if offloaded else torch.optim.Adagrad
    if name == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb
    if name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        return DeepSpeedCPULion if offloaded else FusedLion
    return None  # the muP optimizers: mup's own classes


def check_params(name: str, params: dict, offloaded: bool, key: str = "optimizer.params") -> None:
    """Refuse `params` the optimizer's constructor does not take, read from its signature (the engine's
    TypeError would come mid-start-up)."""
    if "max_grad_norm" in params:
        raise ConfigError(f"{key}.max_grad_norm", "DeepSpeed clips gradients itself",
                          "remove it and set gradient_clipping (train.grad_clip=...)")
    cls = _implementation(name, offloaded, bool(params.get("torch_adam")))
    if cls is None:
        return
    accepted = set(inspect.signature(cls).parameters) - {"params", "model_params", "adamw_mode"}
    if name in ("adam", "adamw"):
        accepted |= {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # read by the engine itself
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"{cls.__name__} (what DeepSpeed runs for {name} here) takes no "
                          f"parameter {unknown[0]!r}", f"remove it; it takes: {', '.join(sorted(accepted))}")


def client_spec(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """What the worker builds for client optimizer `name`: {"name", "class", "params"}, from the optimizer
    group's values (`given`: its keys, null where the option leaves one unset)."""
    spec = CLIENT_CLASSES[name]
    extra = sorted(k for k, v in given.items() if v is not None and k not in spec.keys and k != "name")
    if extra:
        raise ConfigError(f"optimizer.{extra[0]}", f"{spec.path} (optimizer={name}) takes no {extra[0]!r}",
                          f"remove optimizer.{extra[0]}; it takes: {', '.join(spec.keys)}")
    params = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in given.items()
              if k in spec.keys and v is not None}
    return {"name": name, "class": spec.path, "params": {**params, **dict(spec.fixed)}}


def client_class(spec: dict[str, Any]) -> Any:
    module, _, cls = spec["class"].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def check_client(spec: dict[str, Any], optimizer_offload: str, device_type: str, key: str = "optimizer.name") -> None:
    """Refuse a client optimizer that cannot run here or that DeepSpeed cannot run with this ZeRO setup.
    DeepSpeed 0.19 runs a client optimizer at every stage, offloaded too once `zero_force_ds_cpu_optimizer` is
    false (the builder sets it; stage 0 with offload the validator refuses for every optimizer). Its NVMe
    swapper moves any state tensor of 1 MiB or more through fp32 buffers of the parameter's length
    (swap_tensor/optimizer_utils.py is_swappable_tensor): fine for fp32 states, not for 8-bit ones."""
    name, cls_spec = spec["name"], CLIENT_CLASSES[spec["name"]]
    module = cls_spec.path.rpartition(".")[0]
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        raise ConfigError(key, f"optimizer={name} needs the `{cls_spec.package}` package, which is not installed",
                          f"pip install {cls_spec.package}")
    if name == "adamw8bit" and optimizer_offload == "nvme":
        raise ConfigError(key, "DeepSpeed's NVMe swapper reads every optimizer state back as fp32 tensors of the "
                          "parameter's length (swap_tensor/partitioned_optimizer_swapper.py): bitsandbytes' uint8 "
                          "states and block scales do not survive it",
                          "offload=cpu (the 8-bit states in host memory), or optimizer=adafactor with offload=nvme")
    if name == "adamw8bit" and (device_type != "cuda" or optimizer_offload != "none") and not _bnb_runs_on_cpu():
        where = "offloaded states live on the host" if device_type == "cuda" else "this machine has no CUDA"
        raise ConfigError(key, f"bitsandbytes' 8-bit AdamW runs on CUDA tensors, and the installed bitsandbytes "
                          f"has no CPU kernels ({where})",
                          "optimizer=adafactor (a factored second moment, no first), or install a bitsandbytes "
                          "with CPU kernels (0.50 has them)")
    check_client_params(spec, key="optimizer")


def check_client_params(spec: dict[str, Any], key: str = "optimizer") -> None:
    """The constructor's own signature answers what it takes: a wrong key is a TypeError only mid-start-up."""
    accepted = set(inspect.signature(client_class(spec)).parameters) - {"params"}
    unknown = sorted(set(spec["params"]) - accepted)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"{spec['class']} takes no parameter {unknown[0]!r}",
                          f"remove it; it takes: {', '.join(sorted(accepted))}")


@functools.cache
def _bnb_runs_on_cpu() -> bool:
    """One 8-bit AdamW step on a small host tensor: the installed bitsandbytes either has CPU kernels or not."""
    import torch

    try:
        import bitsandbytes as bnb

        param = torch.nn.Parameter(torch.ones(4096))
        param.grad = torch.ones(4096)
        bnb.optim.AdamW8bit([param], lr=1e-3).step()
    except Exception:  # noqa: BLE001 - any failure means: no usable CPU path
        return False
    return True


TYPES = {"warmup": "WarmupLR", "warmup_decay": "WarmupDecayLR", "cosine": "WarmupCosineLR", "onecycle": "OneCycle"}
NAMES = (*TYPES, "constant")
# The parameters zerotune sets for each DeepSpeed scheduler (OneCycle: momentum cycling off, it would
# overwrite Adam's betas).
PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("total_num_steps", "warmup_num_steps", "warmup_min_ratio", "cos_min_ratio", "warmup_type"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_momentum", "decay_lr_rate"),
}


def derived_params(sched: Scheduler, lrs: list[float], max_steps: int) -> dict:
    """Every scheduler parameter derived from the scheduler group, `lrs` (optimizer.lr, then each trained text
    encoder's) and max_steps: for zerotune's blocks and a user's "auto". WarmupLR and OneCycle set every group to
    their lr, or its own entry of a list (`_format_param`); WarmupCosineLR scales each group's own lr."""
    half = max(max_steps // 2, 1)
    div = float(sched.div_factor)
    top: float | list[float] = lrs[0] if len(lrs) == 1 else list(lrs)
    low: float | list[float] = lrs[0] / div if len(lrs) == 1 else [lr / div for lr in lrs]
    return {"warmup_min_lr": float(sched.min_lr), "warmup_max_lr": top, "warmup_num_steps": int(sched.warmup_steps),
            "warmup_type": sched.warmup_type, "total_num_steps": max_steps,
            "warmup_min_ratio": float(sched.warmup_min_ratio), "cos_min_ratio": float(sched.cos_min_ratio),
            "cycle_min_lr": low, "cycle_max_lr": top, "cycle_first_step_size": half,
            "cycle_second_step_size": max(max_steps - half, 1), "cycle_momentum": False, "decay_lr_rate": 0.0}


def scheduler_block(sched: Scheduler, lrs: list[float], max_steps: int) -> dict | None:
    """DeepSpeed scheduler dict for `sched` (cfg.scheduler), `lrs` one per parameter group; None: constant lrs."""
    name = sched.name
    if name == "constant":
        return None
    if name in ("warmup", "warmup_decay", "cosine"):
        warmup = int(sched.warmup_steps)
        if warmup < 0 or (warmup == 0 and name != "warmup"):
            # DeepSpeed's schedulers refuse 0 warm-up steps; only plain warm-up has a 0-step equivalent.
            raise ConfigError("scheduler.warmup_steps", f"must be >= {0 if name == 'warmup' else 1} for "
                              f"scheduler={name}, got {warmup}", "scheduler.warmup_steps=100")
        if warmup == 0:
            return None  # WarmupLR with no warm-up is the optimizer's lr throughout
        if name != "warmup" and warmup >= max_steps:
            fix = f"scheduler.warmup_steps={max(max_steps // 10, 1)}" if max_steps > 1 else "scheduler=constant"
            raise ConfigError("scheduler.warmup_steps", f"{warmup} warm-up steps leave nothing to decay over "
                              f"train.max_steps={max_steps}", fix)
    if name in TYPES:
        kind = TYPES[name]
        values = derived_params(sched, lrs, max_steps)
        return {"type": kind, "params": {k: values[k] for k in PARAMS[kind]}}
    raise ConfigError("scheduler.name", f"unknown scheduler {name!r}", f"choose one of: {', '.join(NAMES)}")

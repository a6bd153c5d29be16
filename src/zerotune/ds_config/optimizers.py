"""Optimizer names: normalisation, aliases, and which ones DeepSpeed can run where.

Two kinds: DeepSpeed's own (built by the engine from the dict's `optimizer` block) and client optimizers
(torch, transformers or bitsandbytes classes zerotune builds and hands to the engine; the dict then has no
`optimizer` block, and `zero_force_ds_cpu_optimizer: false` lets them run on offloaded partitions).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from zerotune.errors import ConfigError

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
    """The engine passes `params` to the optimizer's constructor mid-start-up, where an unknown one is a
    TypeError; the constructor's own signature answers it here."""
    import inspect

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

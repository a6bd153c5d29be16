"""Optimizer names: normalisation, aliases, and which ones DeepSpeed can run where."""

from __future__ import annotations

import importlib.util
import logging

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


def normalize(name: str, key: str = "optimizer.name") -> str:
    """Return the canonical name for `name`, case-insensitively; AdamW aliases fall back with a warning."""
    canon = _canon(name)
    if canon in ADAMW_ALIASES:
        log.warning("optimizer %r is an AdamW implementation, not an optimizer choice: using DeepSpeed's AdamW "
                    "(CPU Adam when offloaded, fused Adam otherwise)", name)
        return "adamw"
    if canon in DEEPSPEED_TYPES:
        return canon
    if canon in NOT_CONFIG_DRIVEN:
        raise ConfigError(key, f"{NOT_CONFIG_DRIVEN[canon]} is not available through a DeepSpeed config dict "
                          "in DeepSpeed 0.19", f"choose one of: {', '.join(DEEPSPEED_TYPES)}")
    raise ConfigError(key, f"unknown optimizer {name!r}",
                      f"choose one of: {', '.join(DEEPSPEED_TYPES)} (case-insensitive)")


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

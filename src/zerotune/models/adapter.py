"""Adapters on the network with peft, as diffusers adds them (`unet.add_adapter`): LoRA (and DoRA, LoRA with a
learned magnitude), LoHa and LoKr (LyCORIS's Hadamard and Kronecker products). The base weights frozen, only the
adapters trainable. The layers, their names and their saving are peft's and diffusers' own."""

from __future__ import annotations

import contextlib
from typing import Any, TypeGuard, TypeVar

import torch

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Adapter, as_dict

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)
ADAPTER_NAME = "default"  # peft's name for a model's first adapter; the exported keys carry no name
INITS = {"gaussian": "gaussian", "default": True}  # adapter.init -> peft's init_lora_weights
KINDS = ("lora", "loha", "lokr")
# Each kind's trainable tensors, by peft's names (LoraLayer / LoHaLayer / LoKrLayer.adapter_layer_names, which
# tests/test_adapters.py checks): written out so that reading a checkpoint does not import peft.
ADAPTER_LAYER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                       "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
                       "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def enabled(adapter_cfg: Adapter | None) -> TypeGuard[Adapter]:
    return adapter_cfg is not None and adapter_cfg.name != "none"


def settings(adapter_cfg: Adapter | None) -> dict | None:
    """The adapter's settings as a plain dict (what a checkpoint's meta.json records), or None for full training."""
    return as_dict(adapter_cfg) if adapter_cfg is not None and enabled(adapter_cfg) else None


def check(adapter_cfg: Adapter | None) -> None:
    """The adapter's own keys, before any model is built."""
    if not enabled(adapter_cfg):
        return
    if adapter_cfg.name not in KINDS:
        raise ConfigError("adapter.name", f"unknown adapter {adapter_cfg.name!r}",
                          "adapter=lora or adapter=loha or adapter=lokr or adapter=none")
    if adapter_cfg.dora and adapter_cfg.name != "lora":
        raise ConfigError("adapter.dora", f"DoRA learns a magnitude beside LoRA's update; adapter={adapter_cfg.name} "
                          "has none", "adapter.dora=false, or adapter=lora adapter.dora=true")
    if adapter_cfg.name != "lora" and str(adapter_cfg.init) != "default":
        raise ConfigError("adapter.init", f"adapter={adapter_cfg.name} starts at zero as peft initialises it; "
                          f"{adapter_cfg.init!r} is LoRA's", "adapter.init=default")
    if int(adapter_cfg.rank) < 1:
        raise ConfigError("adapter.rank", f"must be at least 1, got {adapter_cfg.rank}", "adapter.rank=16")
    if float(adapter_cfg.alpha) <= 0:
        raise ConfigError("adapter.alpha", f"must be positive, got {adapter_cfg.alpha}", "adapter.alpha=16")
    if not 0.0 <= float(adapter_cfg.dropout) < 1.0:
        raise ConfigError("adapter.dropout", f"must be in [0, 1), got {adapter_cfg.dropout}", "adapter.dropout=0.0")
    if str(adapter_cfg.init) not in INITS:
        raise ConfigError("adapter.init", f"unknown init {adapter_cfg.init!r}", f"adapter.init={' or '.join(INITS)}")
    if not list(adapter_cfg.target_modules):
        raise ConfigError("adapter.target_modules", "is empty", "adapter.target_modules=[to_q,to_k,to_v,to_out.0]")


def _matches(name: str, target: str) -> bool:
    # peft's rule for a list of names: the module's full name is the target or ends with "." + target.
    return name == target or name.endswith("." + target)


def _check_targets(module: torch.nn.Module, targets: list[str], key: str) -> None:
    """Every target must name at least one module: peft's own error for an unmatched one comes only when
    none matches, and lists nothing."""
    names = [n for n, _ in module.named_modules() if n]
    for target in targets:
        if not any(_matches(n, target) for n in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules()
                             if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))})
            default = ",".join(getattr(Adapter(), key.rsplit(".", 1)[-1]))  # the schema's own default
            raise ConfigError(key, f"{target!r} matches no module of {type(module).__name__}; its linear and conv "
                              f"modules are named {', '.join(leaves)} (and to_out.0 etc. by their full suffix)",
                              f"{key}=[{default}]")


def add_adapter(module: ModuleT, adapter_cfg: Adapter | None, targets: list[str] | None = None,
                key: str = "adapter.target_modules") -> ModuleT:
    """Freeze `module` and add the LoRA adapter `adapter_cfg` describes (in place; returns it). `targets`: the
    modules it adapts, adapter.target_modules (the U-Net's) unless given (a text encoder's: `key` names them)."""
    if not enabled(adapter_cfg):
        return module
    check(adapter_cfg)
    targets = [str(m) for m in adapter_cfg.target_modules] if targets is None else targets
    _check_targets(module, targets, key)
    module.requires_grad_(False)
    config = peft_config(adapter_cfg, targets)
    # DoRA's magnitudes are the base weights' norms, which peft would gather again (gather_params_ctx) at ZeRO-3,
    # and DeepSpeed refuses a nested gathering of the same parameters: peft is told ZeRO-3 is off meanwhile
    from zerotune.models.weights import transformers_zero3_lifted

    with gathered_targets(targeted_modules(module, adapter_cfg, targets)), transformers_zero3_lifted():
        if hasattr(module, "disable_lora"):  # diffusers' models (PeftAdapterMixin)
            module.add_adapter(config, adapter_name=ADAPTER_NAME)
        else:
            # transformers' add_adapter asks for a newer peft than PyPI holds; its two steps, by peft's function
            from peft import inject_adapter_in_model

            inject_adapter_in_model(config, module, adapter_name=ADAPTER_NAME)
            module.peft_config = {ADAPTER_NAME: config}
    return module


def peft_config(adapter_cfg: Adapter, targets: list[str]) -> Any:
    """peft's config of the adapter's kind. LoHa and LoKr take adapter.dropout as their rank dropout (LyCORIS's
    `dropout` on the rank dimension); they start at zero (init_weights=True)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    rank, alpha, dropout = int(adapter_cfg.rank), float(adapter_cfg.alpha), float(adapter_cfg.dropout)
    if adapter_cfg.name == "loha":
        return LoHaConfig(r=rank, alpha=alpha, rank_dropout=dropout, init_weights=True, target_modules=targets)
    if adapter_cfg.name == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, rank_dropout=dropout, init_weights=True, target_modules=targets)
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=INITS[str(adapter_cfg.init)],
                      target_modules=targets, use_dora=bool(adapter_cfg.dora))


def targeted_modules(module: torch.nn.Module, adapter_cfg: Adapter | None,
                     targets: list[str] | None = None) -> list[torch.nn.Module]:
    """The modules peft wraps (none for full training); `targets` as in add_adapter."""
    if not enabled(adapter_cfg):
        return []
    targets = [str(t) for t in adapter_cfg.target_modules] if targets is None else targets
    return [m for n, m in module.named_modules() if n and any(_matches(n, t) for t in targets)]


def gathered_targets(targets: list[torch.nn.Module]):
    """At ZeRO-3 each target's weight is a 1-D placeholder and peft sizes its layers from the base weight, so the
    targets are gathered whole, read only, while peft wraps them (as peft's own `gather_params_ctx`). The adapters
    are built as plain tensors, which DeepSpeed's engine partitions from rank 0's values: every rank starts from the
    same adapter. The cost: the targets' weights whole, once, before any optimizer state. Elsewhere: a no-op."""
    params = [p for module in targets for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def is_adapter_weight(name: str) -> bool:
    """peft names an adapter's tensors <module>.<layer name>.<adapter>[.weight] (lora_A, hada_w1_a, lokr_w1, ...)."""
    return any(f".{layer}." in name for layer in ADAPTER_LAYER_NAMES)


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer gets: every parameter without an adapter, the adapter's with one."""
    return [p for p in module.parameters() if p.requires_grad]


def adapter_state_dict(unet: torch.nn.Module, state: dict | None = None) -> dict:
    """The adapter's weights under diffusers' LoRA key names (`...to_q.lora_A.weight`), as
    `save_lora_weights` / `load_lora_adapter` read them. `state`: the U-Net's full state dict, when the
    module's own tensors are ZeRO-3 partitions."""
    from peft.utils import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(unet, state_dict=state, adapter_name=ADAPTER_NAME))


# DeepSpeed's muP optimizers need every parameter's base shape (mup.set_base_shapes on the whole model),
# which adapter weights added afterwards do not have; the others step any subset of parameters.
_WHOLE_MODEL_OPTIMIZERS = {"MuAdam", "MuAdamW", "MuSGD"}


def check_optimizer(adapter_cfg: Adapter | None, optimizer_type: str) -> None:
    if enabled(adapter_cfg) and optimizer_type in _WHOLE_MODEL_OPTIMIZERS:
        raise ConfigError("optimizer", f"{optimizer_type} (muP) scales each parameter by its base shape, which the "
                          f"adapter's weights do not have: it cannot train adapter={adapter_cfg.name}",
                          "optimizer=adamw (or adam, adagrad, lion) with the adapter, or adapter=none")

"""The accelerate side, DeepSpeed (any ZeRO stage) or plain accelerate, both driven from the same validated DeepSpeed
dict so the optimizer and scheduler match; what one rank holds of the training state, read from the engine; and the
host EMA (one fp32 copy in host RAM, outside accelerate and DeepSpeed; under ZeRO-3 gathered GATHER_NUMEL elements
at a time, so a rank never holds the whole model beside it)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator

from zerotune.config.accelerate_file import absorbed_launch_environment
from zerotune.config.errors import ConfigError
from zerotune.host.ops_env import link_torch_lib, remember_cpu_info
from zerotune.plan.resolve import ResolvedRun


def mixed_precision(ds: dict) -> str:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "no"


def make_accelerator(resolved: ResolvedRun, collective_timeout_s: float) -> Accelerator:
    """collective_timeout_s: the process group's timeout, where accelerate creates the group (launch.*)."""
    from accelerate.utils import InitProcessGroupKwargs

    ds = resolved.ds_config
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))]
    if resolved.use_deepspeed:
        from accelerate.utils import DeepSpeedPlugin

        link_torch_lib()  # before DeepSpeed loads its ops (torch under a path with a space)
        remember_cpu_info()  # its builders and CPU-Adam ask py-cpuinfo: a new interpreter per question
        with absorbed_launch_environment():  # `accelerate launch`'s settings are in `ds` already
            plugin = DeepSpeedPlugin(hf_ds_config=ds)
            return Accelerator(deepspeed_plugin=plugin, mixed_precision=mixed_precision(ds), kwargs_handlers=handlers)
    return Accelerator(mixed_precision=mixed_precision(ds), cpu=resolved.platform.device_type == "cpu",
                       gradient_accumulation_steps=ds["gradient_accumulation_steps"], kwargs_handlers=handlers)


def zero3_init(accelerator: Accelerator, resolved: ResolvedRun):
    """At ZeRO-3, a `deepspeed.zero.Init` for building the U-Net, so each rank only ever holds its partition;
    else None. accelerate's `zero3_init_flag` decides (on at stage 3 unless ACCELERATE_DEEPSPEED_ZERO3_INIT says
    otherwise), the run's DeepSpeed dict sets the dtype (bf16, fp16 or fp32) and any parameter offload."""
    plugin = accelerator.state.deepspeed_plugin if resolved.use_deepspeed else None
    if plugin is None or not plugin.is_zero3_init_enabled():
        return None
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=plugin.deepspeed_config)


def optimizer_and_scheduler(resolved: ResolvedRun, params):
    """DeepSpeed builds its own from the dict (accelerate's Dummy* placeholders), or is handed the client
    optimizer built here; the plain path mirrors it."""
    ds = resolved.ds_config
    client = resolved.client_optimizer
    if resolved.use_deepspeed:
        from accelerate.utils import DummyOptim, DummyScheduler

        # with a real optimizer, accelerate hands it to deepspeed.initialize; the dict's scheduler wraps it
        opt = client_optimizer(client, params) if client else DummyOptim(params, lr=ds["optimizer"]["params"]["lr"])
        return opt, (DummyScheduler(opt) if "scheduler" in ds else None)
    opt = client_optimizer(client, params) if client else torch_optimizer(ds["optimizer"], params)
    if "scheduler" not in ds:
        return opt, None
    # DeepSpeed's schedulers are plain classes over a torch optimizer: reuse them for identical curves.
    from deepspeed.runtime import lr_schedules

    return opt, getattr(lr_schedules, ds["scheduler"]["type"])(opt, **ds["scheduler"]["params"])


def client_optimizer(spec: dict, params) -> torch.optim.Optimizer:
    """The client optimizer's class (torch, transformers or bitsandbytes) over `params`, as the spec says."""
    from zerotune.config.deepspeed_blocks import client_class

    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in spec["params"].items()}
    return client_class(spec)(params, **kwargs)


def torch_optimizer(block: dict, params) -> torch.optim.Optimizer:
    kind, p = block["type"], {k: v for k, v in block["params"].items() if k not in ("torch_adam", "adam_w_mode")}
    if "betas" in p:
        p["betas"] = tuple(p["betas"])
    # DeepSpeed's "Adam" applies AdamW's decoupled decay unless adam_w_mode is false.
    if kind == "AdamW" or (kind == "Adam" and block["params"].get("adam_w_mode", True)):
        return torch.optim.AdamW(params, **p)
    if kind == "Adam":
        return torch.optim.Adam(params, **p)
    if kind == "Adagrad":
        return torch.optim.Adagrad(params, **p)
    raise ConfigError("optimizer", f"{kind} needs DeepSpeed, which is off for this run",
                      "optimizer=adamw, adam or adagrad without DeepSpeed")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Each storage once: bitsandbytes' 8-bit states all point at one pair of quantisation maps."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr() or id(v)] = _nbytes(v)
    return sum(seen.values())


def partition_bytes(model: Any, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """This rank's bytes of parameters (stage 3: its partitions plus the persistent ones), gradients that survive
    to the step (stage 2: its flat partition; 3: the flat partition buffer), fp32 master weights (0 where the
    optimizer updates the parameters) and optimizer states; padding adds a few elements per tensor or group.
    `model`: the DeepSpeed engine; without DeepSpeed pass the optimizer too."""
    from deepspeed import DeepSpeedEngine

    if not isinstance(model, DeepSpeedEngine):
        module = getattr(model, "module", model)
        params = [p for p in module.parameters()]
        whole = sum(_nbytes(p) for p in params)
        return {"zero_stage": 0, "world_size": _world(), "params_bytes": whole,
                "grads_bytes": sum(_nbytes(p) for p in params if p.requires_grad),
                "master_weights_bytes": 0,
                "optimizer_state_bytes": _state_bytes(optimizer) if optimizer is not None else 0}
    stage = int(model.zero_optimization_stage())
    params = list(model.module.parameters())
    share = {3: _zero3_share, 1: _zero12_share, 2: _zero12_share}.get(stage, _stage0_share)
    params_bytes, grads_bytes, master, state = share(model.optimizer, params, stage)
    return {"zero_stage": stage, "world_size": _world(), "params_bytes": params_bytes, "grads_bytes": grads_bytes,
            "master_weights_bytes": master, "optimizer_state_bytes": state}


def _elem(params: list) -> int:
    trainable = [p for p in params if p.requires_grad]
    return trainable[0].element_size() if trainable else 4


def _zero3_share(zopt: Any, params: list, stage: int) -> tuple[int, int, int, int]:
    trainable = [p for p in params if p.requires_grad]
    params_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                       + (p.ds_numel * p.element_size() if getattr(p, "ds_persist", False) else 0) for p in params)
    flat = getattr(zopt, "grad_partitions_flat_buffer", None)
    grads_bytes = _nbytes(flat) if flat is not None else sum(p.partition_numel() * _elem(params) for p in trainable)
    master = sum(_nbytes(t) for t in zopt.fp32_partitioned_groups_flat)
    return params_bytes, grads_bytes, master, _state_bytes(zopt.optimizer)


def _zero12_share(zopt: Any, params: list, stage: int) -> tuple[int, int, int, int]:
    elem = _elem(params)
    master = sum(_nbytes(t) for t in zopt.single_partition_of_fp32_groups)
    grads_bytes = (sum(int(n) for n in zopt.partition_size) * elem if stage == 2
                   else sum(p.numel() * elem for p in params if p.requires_grad))
    return sum(_nbytes(p) for p in params), grads_bytes, master, _state_bytes(zopt.optimizer)


def _stage0_share(zopt: Any, params: list, stage: int) -> tuple[int, int, int, int]:
    inner = getattr(zopt, "optimizer", zopt)  # bf16/fp16 wrappers hold the torch optimizer
    own = {id(p) for p in params}
    master = sum(_nbytes(p) for g in inner.param_groups for p in g["params"] if id(p) not in own)
    grads_bytes = sum(p.numel() * _elem(params) for p in params if p.requires_grad)
    return sum(_nbytes(p) for p in params), grads_bytes, master, _state_bytes(inner)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


GATHER_NUMEL = 1 << 26  # 256 MiB of fp32 gathered at once at most (one parameter more when it alone is larger)


class HostEMA:
    def __init__(self, named_params, decay: float, warmup: bool, zero3: bool):
        self.decay, self.warmup, self.zero3 = float(decay), bool(warmup), zero3
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {}
        for group in self._groups(list(named_params)):
            with self._gathered([p for _, p in group]):
                self.shadow.update({n: p.detach().to("cpu", torch.float32, copy=True) for n, p in group})

    def current_decay(self) -> float:
        """Warm-up: early averages forget fast, so the EMA does not stay anchored to the random init."""
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, named_params) -> None:
        d = self.current_decay()
        for group in self._groups(list(named_params)):
            with self._gathered([p for _, p in group]):
                for name, p in group:
                    self.shadow[name].lerp_(p.detach().to("cpu", torch.float32), 1.0 - d)
        self.updates += 1

    def _groups(self, named_params: list) -> list[list]:
        if not self.zero3:
            return [named_params]
        groups: list[list] = [[]]
        size = 0
        for name, p in named_params:
            numel = int(getattr(p, "ds_numel", p.numel()))
            if groups[-1] and size + numel > GATHER_NUMEL:
                groups.append([])
                size = 0
            groups[-1].append((name, p))
            size += numel
        return groups

    def _gathered(self, params):
        if not self.zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = int(state["updates"])

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

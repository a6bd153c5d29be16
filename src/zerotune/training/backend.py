"""The accelerate side: DeepSpeed (any ZeRO stage) or plain accelerate (stage 0 without DeepSpeed).

Both are driven from the same validated DeepSpeed dict, so the optimizer and scheduler match.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from accelerate import Accelerator

from zerotune.errors import ConfigError
from zerotune.ops.cpu_info import remember_cpu_info
from zerotune.ops.torch_lib import link_torch_lib
from zerotune.resolved import ResolvedRun
from zerotune.user_config.accelerate_config import absorbed_launch_environment


def mixed_precision(ds: dict) -> str:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "no"


def make_accelerator(run: ResolvedRun, collective_timeout_s: float) -> Accelerator:
    """collective_timeout_s: the process group's timeout, where accelerate creates the group (launch.*)."""
    from accelerate.utils import InitProcessGroupKwargs

    ds = run.ds_config
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s))]
    if run.use_deepspeed:
        from accelerate.utils import DeepSpeedPlugin

        link_torch_lib()  # before DeepSpeed loads its ops (torch under a path with a space)
        remember_cpu_info()  # its builders and CPU-Adam ask py-cpuinfo: a new interpreter per question
        with absorbed_launch_environment():  # `accelerate launch`'s settings are in `ds` already
            plugin = DeepSpeedPlugin(hf_ds_config=ds)
            return Accelerator(deepspeed_plugin=plugin, mixed_precision=mixed_precision(ds), kwargs_handlers=handlers)
    return Accelerator(mixed_precision=mixed_precision(ds), cpu=run.platform.device_type == "cpu",
                       gradient_accumulation_steps=ds["gradient_accumulation_steps"], kwargs_handlers=handlers)


def zero3_init(accelerator: Accelerator, run: ResolvedRun):
    """At ZeRO-3, a `deepspeed.zero.Init` for building the U-Net, so each rank only ever holds its partition;
    else None. accelerate's `zero3_init_flag` decides (on at stage 3 unless ACCELERATE_DEEPSPEED_ZERO3_INIT says
    otherwise), the run's DeepSpeed dict sets the dtype (bf16, fp16 or fp32) and any parameter offload."""
    plugin = accelerator.state.deepspeed_plugin if run.use_deepspeed else None
    if plugin is None or not plugin.is_zero3_init_enabled():
        return None
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=plugin.deepspeed_config)


def optimizer_and_scheduler(run: ResolvedRun, params):
    """DeepSpeed builds its own from the dict (accelerate's Dummy* placeholders), or is handed the client
    optimizer built here; the plain path mirrors it."""
    ds = run.ds_config
    client = run.client_optimizer
    if run.use_deepspeed:
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
    from zerotune.ds_config.optimizers import client_class

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

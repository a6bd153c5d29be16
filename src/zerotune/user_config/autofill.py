"""`"auto"` in a DeepSpeed file means "fill this from the run's settings", as accelerate and the HF Trainer
read it. zerotune fills every "auto" before validation, so nothing downstream (accelerate's own filler
included) ever sees one; an "auto" it has no value for is a config error naming the key.

Bucket sizes: accelerate derives them from `model.config.hidden_size`, which U-Nets lack. zerotune's
rule is DeepSpeed's own default capped at the model's parameter count (`deepspeed.*_bucket_size=auto`),
or the number set in `deepspeed.*`.
"""

from __future__ import annotations

from typing import Any

from zerotune.ds_config.batch import Batch
from zerotune.ds_config.builder import DEFAULT_BUCKETS, bucket_size, optimizer_block
from zerotune.ds_config.schedulers import derived_params
from zerotune.errors import ConfigError
from zerotune.models import ModelStats, text_encoders
from zerotune.schema import Config

AUTO = "auto"


def fill(ds: dict, cfg: Config, stats: ModelStats, batch: Batch, source: str) -> dict:
    """`ds` with every "auto" replaced; `source` names the file in errors."""
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

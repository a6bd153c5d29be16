"""Resuming: which checkpoint `resume` names, whether this run can continue it, and loading it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotune import __version__
from zerotune.errors import ConfigError
from zerotune.training.checkpoint import convert
from zerotune.training.checkpoint.store import EMA_FILE, find, latest, read_meta

log = logging.getLogger(__name__)

# What a checkpoint records about how it was trained; a difference means a conversion.
_TOPOLOGY = ("zero_stage", "world_size", "use_deepspeed", "precision", "offload", "offload_params")


def resolve_resume(resume: Any, checkpoint_dir: Any) -> Path | None:
    """`resume` as a checkpoint folder (see conf/config.yaml for the rule), or None."""
    if resume in (None, "", False):
        return None
    if str(resume) == "latest":
        if not checkpoint_dir:
            raise ConfigError("resume", "resume=latest looks in checkpoint.dir, which is unset (a new run gets a "
                              "new run dir, whose checkpoints/ is empty)",
                              "resume=latest checkpoint.dir=<old run dir>/checkpoints, or resume=<old run dir>")
        found = latest(Path(str(checkpoint_dir)).expanduser())
        if found is None:
            raise ConfigError("resume", f"no complete checkpoint under {checkpoint_dir}",
                              "point checkpoint.dir at a folder holding step-NNNNNNN/ checkpoints, or resume=null")
        return found
    path = Path(str(resume)).expanduser()
    found = find(path)
    if found is None:
        raise ConfigError("resume", f"{path} is not a complete checkpoint and holds none (an interrupted save "
                          "leaves no COMPLETE marker and is ignored)",
                          "resume=<run dir>, resume=<run dir>/checkpoints/step-NNNNNNN, or resume=latest")
    return found


def current_meta(cfg: Any, ds_config: dict, use_deepspeed: bool, world_size: int) -> dict:
    """What this run would record in meta.json."""
    zero = ds_config["zero_optimization"]
    return {"zero_stage": int(zero["stage"]) if use_deepspeed else 0, "world_size": int(world_size),
            "use_deepspeed": bool(use_deepspeed), "precision": cfg.precision.name,
            "offload": cfg.offload.device, "offload_params": bool(zero.get("offload_param")),
            "model": cfg.model.name, "optimizer": ds_config["optimizer"]["type"],
            "zerotune_version": __version__}


@dataclass
class ResumeDecision:
    path: Path
    mode: str          # native | universal | full
    meta: dict
    changed: dict      # key -> (checkpoint's, now)


def decide_resume(path: Path | None, now: dict, ds_config: dict) -> ResumeDecision | None:
    """How to load checkpoint `path` into a run described by `now` (current_meta), before any model or engine
    exists; sets DeepSpeed's load_universal in `ds_config` when needed."""
    if path is None:
        return None
    meta = read_meta(path)
    if meta.get("model") != now["model"]:
        raise ConfigError("resume", f"checkpoint {path} holds model={meta.get('model')}, this run is "
                          f"model={now['model']}", f"model={meta.get('model')}")
    changed = {k: (meta.get(k), now[k]) for k in _TOPOLOGY if meta.get(k) != now[k]}
    mode = "native" if not changed else conversion_mode(path, meta, now)
    if mode == "universal":
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    if changed:
        log.warning("resuming %s across changes %s: %s conversion", path, changed, mode)
    return ResumeDecision(path=path, mode=mode, meta=meta, changed=changed)


def _export_fix(path: Path) -> str:
    return (f"resume with the checkpoint's own settings, or export the weights and start from them "
            f"(optimizer state restarts): python -m zerotune.export {path} <out> && train model.pretrained=<out>")


def conversion_mode(path: Path, meta: dict, now: dict) -> str:
    """universal (to ZeRO-1/2/3) or full (to stage 0); refuses what cannot be converted."""
    src_zero = meta["use_deepspeed"] and meta["zero_stage"] >= 1
    if "nvme" in (meta["offload"], now["offload"]):
        raise ConfigError("offload", "resuming across a change of ZeRO stage, DeepSpeed or process count is not "
                          "supported with NVMe offload on either side (its optimizer states live in swap files)",
                          _export_fix(path))
    if now["zero_stage"] >= 1:
        if not src_zero:
            raise ConfigError("zero_stage", f"checkpoint {path} was saved at stage 0 "
                              f"({'DeepSpeed' if meta['use_deepspeed'] else 'plain accelerate'}); continuing it "
                              f"under ZeRO-{now['zero_stage']} is not supported", _export_fix(path))
        return "universal"
    if now["optimizer"] not in ("AdamW", "Adam") or meta.get("optimizer") != now["optimizer"]:
        raise ConfigError("optimizer", f"converting optimizer state to stage 0 supports Adam/AdamW only "
                          f"(checkpoint {meta.get('optimizer')}, now {now['optimizer']})", _export_fix(path))
    return "full"


@dataclass
class Restored:
    position_state: dict        # this rank's data position and generators (Trainer.load_position_state)
    ema_state: dict | None


def load(acc, decision: ResumeDecision, module, optimizer, scheduler) -> Restored:
    """Restore the checkpoint into the prepared engine/optimizer/scheduler (every rank)."""
    if decision.mode == "native":
        acc.load_state(str(decision.path))
    elif decision.mode == "universal":
        acc.load_state(str(convert.universal_folder(acc, decision.path)))
    else:
        convert.load_full(acc, decision.path, decision.meta, module, optimizer, scheduler)
    ema_file = decision.path / EMA_FILE
    ema = torch.load(ema_file, map_location="cpu", weights_only=True) if ema_file.is_file() else None
    acc.wait_for_everyone()
    return Restored(position_state=_trainer_state(decision.path, acc.process_index), ema_state=ema)


def _trainer_state(path: Path, rank: int) -> dict:
    file = path / f"trainer_state_{rank}.pt"
    return torch.load(file if file.is_file() else path / "trainer_state_0.pt", weights_only=False)

"""Checkpoints across DeepSpeed changes: universal checkpoints, and full fp32 state for stage 0 and export.

DEPENDS ON DeepSpeed 0.19.8 INTERNALS: the file names of its checkpoints, ds_to_universal's arguments and
output layout, and what ZeRO-3's universal loader reads. This is the only module that does; re-check it
when DeepSpeed changes (tests/test_checkpoint.py's stage-change resumes cover it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from zerotune.checkpoints.layout import LATEST, read_meta
from zerotune.models import adapter

DS_TAG = "pytorch_model"  # accelerate's folder name for DeepSpeed's checkpoint (MODEL_NAME)
UNIVERSAL = "universal"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-0/1/2, ZeRO-3


def universal_folder(acc, path: Path) -> Path:
    """DeepSpeed's universal checkpoint of `path`, made once by rank 0 into <path>/universal/ (tmp, rename)."""
    out = path / UNIVERSAL
    if acc.is_main_process and not (out / DS_TAG / "zero").is_dir():
        from argparse import Namespace

        from deepspeed.checkpoint import ds_to_universal

        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        args = Namespace(input_folder=str(path / DS_TAG), output_folder=str(tmp / DS_TAG), num_extract_workers=1,
                         num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        ds_to_universal.main(args)
        _alias_model_states(tmp / DS_TAG)
        (tmp / LATEST).write_text(DS_TAG)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    acc.wait_for_everyone()
    return out


def _alias_model_states(folder: Path) -> None:
    """ZeRO-3 engines look for zero_pp_rank_0_mp_rank_00_model_states.pt, ZeRO-1/2 for mp_rank_00_model_states.pt:
    a universal checkpoint loads into either, so both names are provided (the weights come from zero/)."""
    plain, zero3 = (folder / name for name in MODEL_STATES)
    if plain.is_file() and not zero3.is_file():
        shutil.copy2(plain, zero3)
    elif zero3.is_file() and not plain.is_file():
        shutil.copy2(zero3, plain)
    # ZeRO-3's universal loader reads the step and hyper-parameters from a nested optimizer_state_dict,
    # which a ZeRO-1/2 conversion does not write: add it (ZeRO-1/2 read the top-level param_groups).
    state_file = folder / "zero" / "optimizer_state.pt"
    sd = torch.load(state_file, weights_only=False)
    if "optimizer_state_dict" not in sd:
        step = next((float(_part(p, "step")) for p in (folder / "zero").iterdir() if (p / "step.pt").is_file()), 0.0)
        sd["optimizer_state_dict"] = {"state": {0: {"step": torch.tensor(step)}}, "param_groups": sd["param_groups"]}
        torch.save(sd, state_file)


def full_state(path: Path, with_optimizer: bool = True) -> tuple[dict, dict | None, dict | None]:
    """(fp32 weights by name, {name: adam state} or None, scheduler state or None) from any checkpoint; a
    ZeRO-1/2/3 one's optimizer state comes from its universal conversion (`universal_folder`)."""
    meta = read_meta(path)
    if not meta["use_deepspeed"]:
        return _plain_state(path, meta, with_optimizer)
    file = next(path / DS_TAG / n for n in MODEL_STATES if (path / DS_TAG / n).is_file())
    model_states = torch.load(file, map_location="cpu", weights_only=False)
    sched = model_states.get("lr_scheduler")
    if meta["zero_stage"] == 0:
        weights = {k: v.float() for k, v in model_states["module"].items()}
        return weights, _by_name(weights, model_states["optimizer"], meta) if with_optimizer else None, sched
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not with_optimizer:
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG)), None, sched
    weights, opt = _universal_state(path)
    if meta.get("adapter_config") is not None and meta["zero_stage"] == 3:
        # A ZeRO-3 conversion holds what the optimizer held: the frozen base comes from the checkpoint itself.
        weights = {**get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG), **weights}
    return weights, opt, sched


def _plain_state(path: Path, meta: dict, with_optimizer: bool) -> tuple[dict, dict | None, dict | None]:
    """accelerate's own files (no DeepSpeed): model.safetensors, optimizer.bin, scheduler.bin."""
    from safetensors.torch import load_file

    weights = {k.removeprefix("module."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    if not with_optimizer:
        return weights, None, None
    opt = _by_name(weights, torch.load(path / "optimizer.bin", weights_only=False), meta)
    sched_file = path / "scheduler.bin"
    return weights, opt, torch.load(sched_file, weights_only=False) if sched_file.is_file() else None


def _universal_state(path: Path) -> tuple[dict, dict]:
    """fp32 weights and Adam moments per parameter, from the universal conversion of a ZeRO-1/2/3 checkpoint."""
    zero = path / UNIVERSAL / DS_TAG / "zero"
    # ZeRO-3 conversions store flat tensors (reshaped on loading) and one step for all parameters.
    global_sd = torch.load(zero / "optimizer_state.pt", weights_only=False)
    global_step = global_sd.get("optimizer_state_dict", {}).get("state", {}).get(0, {}).get("step", 0.0)
    weights, opt = {}, {}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        step = float(_part(folder, "step")) if (folder / "step.pt").is_file() else float(global_step)
        weights[folder.name] = _part(folder, "fp32").float()
        if (folder / "exp_avg.pt").is_file():  # frozen parameters (under an adapter) have weights only
            opt[folder.name] = {"step": torch.tensor(step), "exp_avg": _part(folder, "exp_avg"),
                                "exp_avg_sq": _part(folder, "exp_avg_sq")}
    return weights, opt


def _part(folder: Path, name: str) -> torch.Tensor:
    loaded = torch.load(folder / f"{name}.pt", weights_only=False)
    return loaded["param"] if isinstance(loaded, dict) else loaded


def _by_name(weights: dict, torch_opt_state: dict, meta: dict) -> dict:
    """A torch optimizer state_dict (indexed by the trained parameters' order) as {parameter name: state}.
    The trained parameters: all of them, or under an adapter the adapter's."""
    names = [n for n in weights if meta.get("adapter_config") is None or adapter.is_adapter_weight(n)]
    order = [i for g in torch_opt_state["param_groups"] for i in g["params"]]
    return {names[pos]: torch_opt_state["state"][i] for pos, i in enumerate(order) if i in torch_opt_state["state"]}


def load_full(acc, path: Path, meta: dict, module, optimizer, scheduler) -> None:
    """Stage 0 (plain or DeepSpeed) from any checkpoint: full weights + Adam moments + scheduler position.
    `optimizer` and `scheduler` are the torch objects under accelerate's wrappers."""
    if meta["use_deepspeed"] and meta["zero_stage"] >= 1:
        universal_folder(acc, path)  # rank 0 converts; the others wait for it
    weights, opt_by_name, sched = full_state(path)
    shapes = {n: p.shape for n, p in module.named_parameters()}
    module.load_state_dict({n: w.reshape(shapes[n]) if n in shapes else w for n, w in weights.items()})
    state = optimizer.state_dict()
    index = {name: i for i, name in enumerate(n for n, p in module.named_parameters() if p.requires_grad)}
    state["state"] = {index[n]: {k: (v.clone() if k == "step" else v.reshape(shapes[n]).clone()) for k, v in s.items()}
                      for n, s in (opt_by_name or {}).items()}
    optimizer.load_state_dict(state)
    if sched is not None and scheduler is not None:
        scheduler.load_state_dict(sched)
        if hasattr(scheduler, "last_batch_iteration"):  # DeepSpeed's schedulers: re-apply that step's lr
            scheduler.step(scheduler.last_batch_iteration)

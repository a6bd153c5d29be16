"""Checkpoint I/O with the model: crash-safe saves, keep_last, a run's saves, stale NVMe swap folders, loading
(natively or converted), universal checkpoints and full fp32 state. DEPENDS ON DeepSpeed 0.19.8 INTERNALS (its
checkpoint file names, ds_to_universal, what ZeRO-3's universal loader reads), the only module that does: re-check
it when DeepSpeed changes (tests/test_checkpoint.py's stage-change resumes cover it)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch

from zerotune.config.files import write_text_atomic
from zerotune.host.process import pause
from zerotune.models import adapter
from zerotune.rundir import checkpoints, resume
from zerotune.rundir.checkpoints import (
    COMPLETE,
    EMA_FILE,
    LATEST,
    META,
    TMP_PREFIX,
    is_step_dir,
    list_complete,
    read_meta,
    step_dir,
    tmp_dir,
)
from zerotune.rundir.resume import ResumeDecision


@dataclass
class SaveRequest:
    """What one save writes, besides accelerate's own state: given by the trainer, explicitly."""

    root: Path
    step: int
    meta: dict
    position_state: dict          # this rank's data position and generators
    unet: Any                     # the unwrapped U-Net (its config is saved)
    encoder_configs: dict[str, Any] = field(default_factory=dict)  # trained text encoders' configs: <name>/config.json
    job: str = "job"              # names the temporary folder: two jobs never share one
    size_estimate: int = 0        # bytes, for the first save's space check (later ones use the previous save)
    ema_state: dict | None = None
    keep_last: int = 0


class SavedCheckpoint(TypedDict):
    """A save as summary.json's checkpoints list records it (with its step)."""

    path: str       # the published checkpoint folder
    seconds: float  # the save's wall time, on this rank
    bytes: int      # what rank 0 published (0 on the other ranks)


def save(acc, request: SaveRequest) -> SavedCheckpoint:
    """Save on EVERY rank (a rank-0-only save hangs under DeepSpeed). Crash-safe: written into a job-private
    `.tmp-step-NNNNNNN-<job>/`, renamed whole, then COMPLETE and `latest` by write-then-rename."""
    t0 = time.perf_counter()
    final, tmp = step_dir(request.root, request.step), tmp_dir(request.root, request.step, request.job)
    if acc.is_main_process:
        request.root.mkdir(parents=True, exist_ok=True)
        checkpoints.check_room(request.root, request.size_estimate)  # before a byte is written
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    try:
        acc.save_state(str(tmp))
        torch.save(request.position_state, tmp / f"trainer_state_{acc.process_index}.pt")
        if acc.is_main_process:
            if request.ema_state is not None:
                torch.save(request.ema_state, tmp / EMA_FILE)
            request.unet.save_config(tmp)
            for name, config in request.encoder_configs.items():  # what export rebuilds each encoder from
                config.save_pretrained(tmp / name)
            (tmp / META).write_text(json.dumps({**request.meta, "step": request.step}, indent=2))
    except Exception as exc:
        raise _failed_save(exc, tmp, request) from exc
    pause(f"save-{request.step}")
    acc.wait_for_everyone()
    size = _publish(tmp, final, request) if acc.is_main_process else 0
    acc.wait_for_everyone()
    return SavedCheckpoint(path=str(final), seconds=time.perf_counter() - t0, bytes=size)


def _failed_save(exc: Exception, tmp: Path, request: SaveRequest) -> Exception:
    """The partial save goes (it would hold the disk full); a full disk is said in plain words."""
    written = checkpoints.folder_bytes(tmp) if tmp.is_dir() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    if not checkpoints.is_disk_full(exc, request.root):
        return exc
    needed, basis = checkpoints.estimate(request.root, request.size_estimate)
    return checkpoints.CheckpointSpaceError(request.root, max(needed, written), checkpoints.free_bytes(request.root),
                                      f"{basis}; {written / checkpoints.MIB:.1f} MiB were written before it failed",
                                      during=True)


def _publish(tmp: Path, final: Path, request: SaveRequest) -> int:
    """Rank 0: make the written folder the checkpoint, durably, then mark it complete with its manifest."""
    record = checkpoints.build(tmp, request.step, durable=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(final / COMPLETE, checkpoints.dumps(record), durable=True)
    write_text_atomic(Path(request.root) / LATEST, final.name + "\n", durable=True)
    cleanup(request.root, request.keep_last, keep=final)
    return sum(f["bytes"] for f in record["files"].values())


def cleanup(root: Path, keep_last: int, keep: Path | None = None) -> None:
    """Delete interrupted saves and all but the newest `keep_last` complete checkpoints (0 keeps all), never
    `keep` (this run's save, maybe older than an earlier run's steps). Only the lock's holder saves here."""
    root = Path(root)
    done = set(list_complete(root))
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX) or (is_step_dir(p) and p not in done):
            shutil.rmtree(p, ignore_errors=True)
    ordered = list_complete(root)
    for p in ordered[:-keep_last] if keep_last > 0 else []:
        if keep is not None and p == Path(keep):
            continue
        (p / COMPLETE).unlink()  # incomplete first, so a crash mid-delete leaves no half checkpoint marked done
        shutil.rmtree(p, ignore_errors=True)


log = logging.getLogger(__name__)


class RunSaves:
    def __init__(self, settings: Any, run_dir: Path, resumed: resume.ResumeDecision | None) -> None:
        self.settings, self.resumed = settings, resumed
        self.root = checkpoints.checkpoint_root(settings.dir, run_dir)
        self.job = checkpoints.job_token(run_dir)
        self.saved: list[dict] = []        # this run's checkpoints
        self.final: str | None = None      # the last step's, once training completed

    def due(self, step: int) -> bool:
        every = self.settings.every_n_steps
        return every > 0 and step % every == 0

    def save(self, accelerator: Any, step: int, request: Callable[[], SaveRequest]) -> None:
        """Save `step` (every rank calls it) unless it is saved already; `request` builds what it holds."""
        if (self.saved and self.saved[-1]["step"] == step) or self._resumed_at(step):
            return
        info = save(accelerator, request())
        self.saved.append({"step": step, **info})
        log.info("checkpoint %s (%.1f MiB, %.1f s)", info["path"], info["bytes"] / 2**20, info["seconds"])

    def save_final(self, step: int, save: Callable[[], None]) -> None:
        """The completed run's last step (checkpoint.final), unless a periodic save or the checkpoint this run
        resumed from already holds it. Every rank calls it."""
        if not self.settings.final or step == 0:
            return
        if self._resumed_at(step):
            self.final = str(checkpoints.step_dir(self.root, step))  # resumed at max_steps: nothing to rewrite
            return
        save()
        self.final = self.saved[-1]["path"]

    def _resumed_at(self, step: int) -> bool:
        """Whether `step` is the checkpoint this run resumed from: rewriting it would only risk the newest save."""
        here = checkpoints.step_dir(self.root, step)
        return self.resumed is not None and self.resumed.path.absolute() == here.absolute()

    def summary(self) -> dict:
        last = checkpoints.latest(self.root)
        out: dict[str, Any] = {"saved": self.saved, "last_complete": str(last) if last is not None else None, "final": self.final}
        rp = self.resumed
        if rp is not None:
            out["resumed_from"] = {"path": str(rp.path), "step": rp.meta.get("step"), "mode": rp.mode,
                                   "changed": {k: list(v) for k, v in rp.changed.items()}}
        return out


def clean_stale_swap(root: str | Path) -> list[str]:
    """Remove DeepSpeed's swap folders (zero_stage_*) a killed run left directly inside `root`, nothing outside
    it: a symlink among them is unlinked, never followed."""
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        return []
    real_root, removed = root.resolve(), []
    for entry in root.iterdir():
        if not entry.name.startswith("zero_stage_"):
            continue
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink()
        elif entry.resolve().parent == real_root:
            shutil.rmtree(entry)
        else:
            continue
        removed.append(str(entry))
    return removed


DS_TAG = "pytorch_model"  # accelerate's folder name for DeepSpeed's checkpoint (MODEL_NAME)
UNIVERSAL = "universal"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-0/1/2, ZeRO-3


def universal_folder(acc, path: Path) -> Path:
    """DeepSpeed's universal checkpoint of `path`, made once by rank 0 into <path>/universal/ (tmp, rename)."""
    out = path / UNIVERSAL
    if acc.is_main_process and not (out / DS_TAG / "zero").is_dir():
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
    """(fp32 weights by name, {name: adam state} or None, scheduler state or None) from any checkpoint (ZeRO-1/2/3
    through `universal_folder`)."""
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
    """A torch optimizer state_dict (indexed by the trained parameters' order) as {parameter name: state}."""
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


def load(acc, decision: ResumeDecision, module, optimizer, scheduler) -> tuple[dict, dict | None]:
    """Restore the checkpoint into the prepared engine/optimizer/scheduler (every rank); returns this rank's
    data position and generators (Trainer.load_position_state), and the EMA's state or None."""
    if decision.mode == "native":
        acc.load_state(str(decision.path))
    elif decision.mode == "universal":
        acc.load_state(str(universal_folder(acc, decision.path)))
    else:
        load_full(acc, decision.path, decision.meta, module, optimizer, scheduler)
    _steps_as_tensors(optimizer)
    ema_file = decision.path / EMA_FILE
    ema = torch.load(ema_file, map_location="cpu", weights_only=True) if ema_file.is_file() else None
    acc.wait_for_everyone()
    state_file = decision.path / f"trainer_state_{acc.process_index}.pt"
    if not state_file.is_file():
        state_file = decision.path / "trainer_state_0.pt"
    return torch.load(state_file, weights_only=False), ema


def _steps_as_tensors(optimizer) -> None:
    """An offload=cpu checkpoint (CPU Adam) holds each step as an int; torch's Adam/AdamW need a singleton tensor
    and their load_state_dict converts nothing. CPU Adam itself takes either."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a ZeRO optimizer wraps the one that steps
    if not isinstance(inner, torch.optim.Optimizer) or type(inner).__module__.startswith("deepspeed."):
        return
    for state in inner.state.values():
        if "step" in state and not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)

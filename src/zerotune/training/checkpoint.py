"""Checkpoints: save, find the latest complete one, resume (also across DeepSpeed changes), clean up.

Layout of one checkpoint, `<checkpoint.dir>/step-NNNNNNN/`:

    pytorch_model/            DeepSpeed's own checkpoint (model, optimizer partitions, scheduler), or
    model.safetensors ...     accelerate's files on the plain (no DeepSpeed) path
    random_states_<rank>.pkl  torch / numpy / python RNG of each rank (accelerate)
    trainer_state_<rank>.pt   step, data position, the Trainer's own generators
    ema.pt                    the host EMA (rank 0), when enabled
    unet_config.json          the U-Net's architecture, for export
    meta.json                 zero stage, world size, use_deepspeed, precision, offload, model, version
    COMPLETE                  written last: a folder without it is ignored

Crash safety: every rank writes into `.tmp-step-NNNNNNN/`; after a barrier rank 0 renames it to
`step-NNNNNNN/`, then writes COMPLETE and the `latest` pointer (each by write-then-rename).
A process killed at any moment leaves either the previous complete checkpoint or the new one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotune.errors import ConfigError

log = logging.getLogger(__name__)

COMPLETE, META, LATEST, EMA_FILE, UNET_CONFIG = "COMPLETE", "meta.json", "latest", "ema.pt", "unet_config.json"
DS_TAG = "pytorch_model"  # accelerate's folder name for DeepSpeed's checkpoint (MODEL_NAME)
UNIVERSAL = "universal"
_STEP_RE = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------- finding checkpoints


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (path / COMPLETE).is_file() and (path / META).is_file()


def list_complete(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (scanned: the `latest` file is a convenience only)."""
    done = list_complete(root)
    return done[-1] if done else None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def checkpoint_root(cfg: Any, run_dir: Path | None) -> Path:
    configured = cfg.checkpoint.get("dir")
    if configured:
        return Path(str(configured)).expanduser()
    if run_dir is None:
        raise ConfigError("checkpoint.dir", "no run directory to put checkpoints in", "checkpoint.dir=/some/folder")
    return Path(run_dir) / "checkpoints"


def resolve_resume(cfg: Any) -> Path | None:
    """`resume` as a checkpoint folder (see conf/config.yaml for the rule), or None."""
    value = cfg.get("resume")
    if value in (None, "", False):
        return None
    if str(value) == "latest":
        if not cfg.checkpoint.get("dir"):
            raise ConfigError("resume", "resume=latest looks in checkpoint.dir, which is unset (a new run gets a "
                              "new run dir, whose checkpoints/ is empty)",
                              "resume=latest checkpoint.dir=<old run dir>/checkpoints, or resume=<old run dir>")
        found = latest(Path(str(cfg.checkpoint.dir)).expanduser())
        if found is None:
            raise ConfigError("resume", f"no complete checkpoint under {cfg.checkpoint.dir}",
                              "point checkpoint.dir at a folder holding step-NNNNNNN/ checkpoints, or resume=null")
        return found
    path = Path(str(value)).expanduser()
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        found = latest(root)
        if found is not None:
            return found
    raise ConfigError("resume", f"{path} is not a complete checkpoint and holds none (an interrupted save "
                      "leaves no COMPLETE marker and is ignored)",
                      "resume=<run dir>, resume=<run dir>/checkpoints/step-NNNNNNN, or resume=latest")


# ---------------------------------------------------------------- metadata and resume planning


def current_meta(cfg: Any, checked, world_size: int) -> dict:
    from zerotune import __version__

    stage = int(checked.ds_config["zero_optimization"]["stage"]) if checked.use_deepspeed else 0
    return {"zero_stage": stage, "world_size": int(world_size), "use_deepspeed": bool(checked.use_deepspeed),
            "precision": str(cfg.precision.name), "offload": str(cfg.offload.device),
            "offload_params": bool(checked.ds_config["zero_optimization"].get("offload_param")),
            "model": str(cfg.model.name), "optimizer": checked.ds_config["optimizer"]["type"],
            "zerotune_version": __version__}


_TOPOLOGY = ("zero_stage", "world_size", "use_deepspeed", "precision", "offload", "offload_params")


@dataclass
class ResumeDecision:
    path: Path
    mode: str          # native | universal | full
    meta: dict
    changed: dict      # key -> (checkpoint's, now)


def _export_fix(path: Path) -> str:
    return (f"resume with the checkpoint's own settings, or export the weights and start from them "
            f"(optimizer state restarts): python -m zerotune.export {path} <out> && train model.pretrained=<out>")


def decide_resume(cfg: Any, checked, world_size: int) -> ResumeDecision | None:
    """Decide how to load `resume`, before any model or engine exists; sets load_universal when needed."""
    path = resolve_resume(cfg)
    if path is None:
        return None
    meta, now = read_meta(path), current_meta(cfg, checked, world_size)
    if meta.get("model") != now["model"]:
        raise ConfigError("resume", f"checkpoint {path} holds model={meta.get('model')}, this run is "
                          f"model={now['model']}", f"model={meta.get('model')}")
    changed = {k: (meta.get(k), now[k]) for k in _TOPOLOGY if meta.get(k) != now[k]}
    mode = "native" if not changed else _conversion(path, meta, now)
    if mode == "universal":
        checked.ds_config.setdefault("checkpoint", {})["load_universal"] = True
    if changed:
        log.warning("resuming %s across changes %s: %s conversion", path, changed, mode)
    return ResumeDecision(path=path, mode=mode, meta=meta, changed=changed)


def _conversion(path: Path, meta: dict, now: dict) -> str:
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


# ---------------------------------------------------------------- saving


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _jsonable(value):
    """Config values JSON lacks: tuples and sets as lists, paths as strings."""
    return str(value) if isinstance(value, Path) else list(value)


def save(trainer, root: Path, meta: dict) -> dict:
    """Save on EVERY rank (a rank-0-only save hangs under DeepSpeed); returns {path, seconds, bytes}."""
    acc, t0 = trainer.accelerator, time.perf_counter()
    final = step_dir(root, trainer.step)
    tmp = final.with_name(f".tmp-{final.name}")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    torch.save(trainer.position_state(), tmp / f"trainer_state_{acc.process_index}.pt")
    if acc.is_main_process:
        if trainer.ema is not None:
            torch.save(trainer.ema.state_dict(), tmp / EMA_FILE)
        (tmp / UNET_CONFIG).write_text(json.dumps(dict(trainer._module().config), default=_jsonable, indent=1))
        (tmp / META).write_text(json.dumps({**meta, "step": trainer.step}, indent=2))
    acc.wait_for_everyone()
    size = 0
    if acc.is_main_process:
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(final / COMPLETE, f"{trainer.step}\n")
        _write_atomic(Path(root) / LATEST, final.name + "\n")
        size = folder_bytes(final)
        cleanup(root, int(trainer.cfg.checkpoint.get("keep_last") or 0))
    acc.wait_for_everyone()
    return {"path": str(final), "seconds": time.perf_counter() - t0, "bytes": size}


def cleanup(root: Path, keep_last: int) -> None:
    """Delete interrupted saves and all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    root = Path(root)
    for p in root.iterdir():
        if p.name.startswith(".tmp-step-") or (_STEP_RE.match(p.name) and not is_complete(p)):
            shutil.rmtree(p, ignore_errors=True)
    done = list_complete(root)
    for p in done[:-keep_last] if keep_last > 0 else []:
        (p / COMPLETE).unlink()  # incomplete first, so a crash mid-delete leaves no half checkpoint marked done
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- NVMe swap


def clean_stale_swap(root: str | Path) -> list[str]:
    """Remove DeepSpeed's swap folders (zero_stage_*) directly inside `root`, and nothing outside it.

    A symlink among them is unlinked, never followed; shutil.rmtree does not follow links inside.
    """
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


# ---------------------------------------------------------------- loading


def load(trainer, rp: ResumeDecision) -> None:
    """Restore everything `rp` names into a built Trainer (every rank)."""
    acc = trainer.accelerator
    if rp.mode == "native":
        acc.load_state(str(rp.path))
    elif rp.mode == "universal":
        acc.load_state(str(universal_folder(acc, rp.path)))
    else:
        _load_full(trainer, rp)
    trainer.load_position_state(_trainer_state(rp.path, acc.process_index), rp.meta["world_size"],
                                acc.num_processes)
    if trainer.ema is not None and (rp.path / EMA_FILE).is_file():
        trainer.ema.load_state_dict(torch.load(rp.path / EMA_FILE, map_location="cpu", weights_only=True))
    acc.wait_for_everyone()


def _trainer_state(path: Path, rank: int) -> dict:
    file = path / f"trainer_state_{rank}.pt"
    return torch.load(file if file.is_file() else path / "trainer_state_0.pt", weights_only=False)


def universal_folder(acc, path: Path) -> Path:
    """DeepSpeed's universal checkpoint of `path`, made once by rank 0 into <path>/universal/ (tmp, rename)."""
    out = path / UNIVERSAL
    if acc.is_main_process and not (out / DS_TAG / "zero").is_dir():
        to_universal(path / DS_TAG, out)
    acc.wait_for_everyone()
    return out


def to_universal(ds_folder: Path, out: Path) -> None:
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    args = Namespace(input_folder=str(ds_folder), output_folder=str(tmp / DS_TAG), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)
    _alias_model_states(tmp / DS_TAG)
    (tmp / LATEST).write_text(DS_TAG)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _alias_model_states(folder: Path) -> None:
    """ZeRO-3 engines look for zero_pp_rank_0_mp_rank_00_model_states.pt, ZeRO-1/2 for mp_rank_00_model_states.pt:
    a universal checkpoint loads into either, so both names are provided (the weights come from zero/)."""
    plain, zero3 = folder / "mp_rank_00_model_states.pt", folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if plain.is_file() and not zero3.is_file():
        shutil.copy2(plain, zero3)
    elif zero3.is_file() and not plain.is_file():
        shutil.copy2(zero3, plain)
    # ZeRO-3's universal loader reads the step and hyper-parameters from a nested optimizer_state_dict,
    # which a ZeRO-1/2 conversion does not write: add it (ZeRO-1/2 read the top-level param_groups).
    state_file = folder / "zero" / "optimizer_state.pt"
    sd = torch.load(state_file, weights_only=False)
    if "optimizer_state_dict" not in sd:
        step = next((_step(p) for p in (folder / "zero").iterdir() if (p / "step.pt").is_file()), 0.0)
        sd["optimizer_state_dict"] = {"state": {0: {"step": torch.tensor(step)}}, "param_groups": sd["param_groups"]}
        torch.save(sd, state_file)


def full_state(path: Path, with_optimizer: bool = True) -> tuple[dict, dict | None, dict | None]:
    """(fp32 weights by name, {name: adam state} or None, scheduler state or None) from any checkpoint."""
    meta = read_meta(path)
    if not meta["use_deepspeed"]:
        from safetensors.torch import load_file

        weights = {k.removeprefix("module."): v for k, v in load_file(str(path / "model.safetensors")).items()}
        opt = sched = None
        if with_optimizer:
            opt = _by_name(weights, torch.load(path / "optimizer.bin", weights_only=False))
            sched_file = path / "scheduler.bin"
            sched = torch.load(sched_file, weights_only=False) if sched_file.is_file() else None
        return weights, opt, sched
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-0/1/2, ZeRO-3
    file = next(path / DS_TAG / n for n in names if (path / DS_TAG / n).is_file())
    model_states = torch.load(file, map_location="cpu", weights_only=False)
    sched = model_states.get("lr_scheduler")
    if meta["zero_stage"] == 0:
        weights = {k: v.float() for k, v in model_states["module"].items()}
        return weights, _by_name(weights, model_states["optimizer"]) if with_optimizer else None, sched
    if not with_optimizer:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG)), None, sched
    zero = path / UNIVERSAL / DS_TAG / "zero"
    if not zero.is_dir():
        to_universal(path / DS_TAG, path / UNIVERSAL)
    # ZeRO-3 conversions store flat tensors (reshaped on loading) and one step for all parameters.
    global_sd = torch.load(zero / "optimizer_state.pt", weights_only=False)
    global_step = global_sd.get("optimizer_state_dict", {}).get("state", {}).get(0, {}).get("step", 0.0)
    weights, opt = {}, {}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        def part(name, folder=folder):
            loaded = torch.load(folder / f"{name}.pt", weights_only=False)
            return loaded["param"] if isinstance(loaded, dict) else loaded
        step = _step(folder) if (folder / "step.pt").is_file() else float(global_step)
        weights[folder.name] = part("fp32").float()
        opt[folder.name] = {"step": torch.tensor(step), "exp_avg": part("exp_avg"), "exp_avg_sq": part("exp_avg_sq")}
    return weights, opt, sched


def _step(folder: Path) -> float:
    file = folder / "step.pt"
    if not file.is_file():
        return 0.0
    value = torch.load(file, weights_only=False)
    value = value.get("param", value) if isinstance(value, dict) else value
    return float(value)


def _by_name(weights: dict, torch_opt_state: dict) -> dict:
    """A torch optimizer state_dict (indexed by parameter order) as {parameter name: state}."""
    names = list(weights)
    order = [i for g in torch_opt_state["param_groups"] for i in g["params"]]
    return {names[pos]: torch_opt_state["state"][i] for pos, i in enumerate(order) if i in torch_opt_state["state"]}


def _load_full(trainer, rp: ResumeDecision) -> None:
    """Stage 0 (plain or DeepSpeed) from any checkpoint: full weights + Adam moments + scheduler position."""
    if rp.meta["use_deepspeed"] and rp.meta["zero_stage"] >= 1:
        universal_folder(trainer.accelerator, rp.path)  # rank 0 converts; the others wait for it
    weights, opt_by_name, sched = full_state(rp.path)
    module = trainer._module()
    shapes = {n: p.shape for n, p in module.named_parameters()}
    module.load_state_dict({n: w.reshape(shapes[n]) if n in shapes else w for n, w in weights.items()})
    target = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    state = target.state_dict()
    index = {name: i for i, name in enumerate(shapes)}
    state["state"] = {index[n]: {k: (v.clone() if k == "step" else v.reshape(shapes[n]).clone()) for k, v in s.items()}
                      for n, s in opt_by_name.items()}
    target.load_state_dict(state)
    scheduler = trainer.raw_scheduler()
    if sched is not None and scheduler is not None:
        scheduler.load_state_dict(sched)
        if hasattr(scheduler, "last_batch_iteration"):  # DeepSpeed's schedulers: re-apply that step's lr
            scheduler.step(scheduler.last_batch_iteration)

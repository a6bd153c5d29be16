"""Whether this run can continue a checkpoint, and how (natively, or converted across a ZeRO-stage, DeepSpeed or
process-count change), from the config and meta.json only; and the lock that keeps one job per checkpoint dir
(two would delete each other's saves): the kernel's flock, so a killed job leaves nothing stale."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from zerotune import __version__
from zerotune.config.errors import ConfigError
from zerotune.config.files import write_json_atomic
from zerotune.config.schema import Checkpoint, Config, as_dict
from zerotune.models.param_groups import ParamGroups
from zerotune.rundir.checkpoints import checkpoint_root, read_meta

log = logging.getLogger(__name__)

# What a checkpoint records about how it was trained; a difference means a conversion.
_TOPOLOGY = ("zero_stage", "world_size", "use_deepspeed", "precision", "offload", "offload_params")


def current_meta(cfg: Config, ds_config: dict, use_deepspeed: bool, world_size: int,
                 client_optimizer: dict | None = None, groups: ParamGroups | None = None) -> dict:
    """What this run would record in meta.json. `client_optimizer`: the one zerotune hands the engine, if any;
    `groups`: the optimizer's parameter groups (None: one per trained module)."""
    zero = ds_config["zero_optimization"]
    optimizer = ds_config["optimizer"]["type"] if client_optimizer is None else client_optimizer["name"]
    return {"zero_stage": int(zero["stage"]) if use_deepspeed else 0, "world_size": int(world_size),
            "use_deepspeed": bool(use_deepspeed), "precision": cfg.precision.name,
            "offload": cfg.offload.device, "offload_params": bool(zero.get("offload_param")),
            "model": cfg.model.name, "optimizer": optimizer, "client_optimizer": client_optimizer is not None,
            "adapter": _adapter(cfg),
            # which text encoders train with the U-Net: the engine module's keys are then prefixed (unet., ...)
            "train_text_encoder": cfg.model.train_text_encoder,
            # The adapter's keys, for export to rebuild it (models/adapter.py reads them).
            "adapter_config": None if cfg.adapter.name == "none" else as_dict(cfg.adapter),
            "zerotune_version": __version__, **(groups.as_meta() if groups is not None else {})}


def _adapter(cfg: Config) -> str:
    adapter = cfg.adapter
    if adapter.name == "none":
        return "none"
    targets = ",".join(str(m) for m in adapter.target_modules)
    described = f"{adapter.name} rank={adapter.rank} alpha={adapter.alpha} targets={targets}"
    if adapter.dora:  # absent before DoRA: older checkpoints keep their description
        described += " dora"
    if cfg.model.train_text_encoder != "none":  # the encoders' adapters too (absent before they trained)
        described += " text_encoder_targets=" + ",".join(str(m) for m in adapter.text_encoder_target_modules)
    return described


def _adapter_fix(path: Path, meta: dict) -> str:
    if meta.get("adapter", "none") == "none":
        return (f"to train an adapter on these weights: zerotune export {path} <out>, then "
                "model.pretrained=<out> adapter=lora")
    return "resume with the checkpoint's adapter settings, or start a new run without resume"


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
    if meta.get("adapter", "none") != now["adapter"]:
        raise ConfigError("adapter", f"checkpoint {path} trained adapter {meta.get('adapter', 'none')}, this run "
                          f"is adapter {now['adapter']}: the trained weights differ", _adapter_fix(path, meta))
    trained, training = meta.get("train_text_encoder", "none"), now["train_text_encoder"]
    if trained != training:
        raise ConfigError("model.train_text_encoder", f"checkpoint {path} trained text encoders {trained!r}, this run "
                          f"{training!r}: the trained modules differ", f"model.train_text_encoder={trained}, or "
                          f"{_export_fix(path)}")
    if meta.get("model") != now["model"]:
        raise ConfigError("resume", f"checkpoint {path} holds model={meta.get('model')}, this run is "
                          f"model={now['model']}", f"model={meta.get('model')}")
    if (meta.get("client_optimizer") or now.get("client_optimizer")) and meta.get("optimizer") != now["optimizer"]:
        raise ConfigError("optimizer", f"checkpoint {path} holds optimizer={meta.get('optimizer')}'s state, this run "
                          f"builds optimizer={now['optimizer']}: one cannot load the other's",
                          f"optimizer={_option(meta.get('optimizer'))}, or {_export_fix(path)}")
    _check_groups(path, meta, now)
    changed = {k: (meta.get(k), now[k]) for k in sorted(_changed(meta, now))}
    mode = "native" if not changed else conversion_mode(path, meta, now)
    if mode == "universal":
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    if changed:
        log.warning("resuming %s across changes %s: %s conversion", path, changed, mode)
    return ResumeDecision(path=path, mode=mode, meta=meta, changed=changed)


def _check_groups(path: Path, meta: dict, now: dict) -> None:
    """A ZeRO-1/2 checkpoint continues at ZeRO-1/2 with its own parameter groups only: both DeepSpeed loaders zip
    the saved groups with the engine's. Other stages rebuild the state parameter by parameter."""
    if not (meta.get("use_deepspeed") and now.get("use_deepspeed")
            and meta.get("zero_stage") in (1, 2) and now.get("zero_stage") in (1, 2)):
        return
    saved, wanted = ParamGroups.from_meta(meta), ParamGroups.from_meta(now)
    saved_count = saved.count if saved is not None else 1
    wanted_count = wanted.count if wanted is not None else 1
    if saved_count == wanted_count and (saved is None or wanted is None or saved.layout == wanted.layout):
        return
    raise ConfigError("deepspeed.param_groups", f"checkpoint {path} holds ZeRO-{meta.get('zero_stage')} optimizer "
                      f"state in {saved_count} parameter group(s) per model; this run cuts {wanted_count}: DeepSpeed "
                      "loads ZeRO-1/2 state group by group", f"deepspeed.param_groups=auto (takes the checkpoint's "
                      f"{saved_count}), or deepspeed.param_groups={saved_count}")


def _option(optimizer: object) -> str:
    """The optimizer group's option for a name meta.json holds (DeepSpeed's type is the option in lower case)."""
    return str(optimizer).lower()


def _changed(meta: dict, now: dict) -> set[str]:
    return {k for k in _TOPOLOGY if meta.get(k) != now[k]}


def _export_fix(path: Path) -> str:
    return (f"resume with the checkpoint's own settings, or export the weights and start from them "
            f"(optimizer state restarts): zerotune export {path} <out> && train model.pretrained=<out>")


def conversion_mode(path: Path, meta: dict, now: dict) -> str:
    """universal (to ZeRO-1/2/3) or full (to stage 0); refuses what cannot be converted."""
    src_zero = meta["use_deepspeed"] and meta["zero_stage"] >= 1
    if meta.get("client_optimizer") or now.get("client_optimizer"):
        name = meta["optimizer"] if meta.get("client_optimizer") else now["optimizer"]
        # ds_to_universal and the stage-0 conversion rebuild Adam's moments by name; a client optimizer's
        # states (Adafactor's factored or flat second moment, 8-bit blocks) have no such rule.
        raise ConfigError("resume", f"checkpoint {path} cannot be converted across {sorted(_changed(meta, now))}: "
                          f"optimizer={name}'s state has no conversion (DeepSpeed converts Adam's moments only)",
                          _export_fix(path))
    if "nvme" in (meta["offload"], now["offload"]):
        raise ConfigError("offload", "resuming across a change of ZeRO stage, DeepSpeed or process count is not "
                          "supported with NVMe offload on either side (its optimizer states live in swap files)",
                          _export_fix(path))
    if now["zero_stage"] in (1, 2) and meta["use_deepspeed"] and meta["zero_stage"] == 3:
        # ds_to_universal writes ZeRO-3's tensors flat and without a ds_version; ZeRO-1/2's loader needs both.
        raise ConfigError("zero_stage", f"checkpoint {path} was saved under ZeRO-3; DeepSpeed's universal checkpoint "
                          f"does not load it into ZeRO-{now['zero_stage']}", "resume it at zero_stage=3 (any "
                          f"process count) or at zero_stage=0; or {_export_fix(path)}")
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


LOCK_FILE = ".zerotune.lock"
OWNER_FILE = ".zerotune.lock.json"  # beside the lock: filelock truncates the lock file when it opens it


class CheckpointDirLock:
    def __init__(self, root: Path, run_dir: str | Path):
        self.root, self.run_dir = Path(root), str(run_dir)
        self._lock: FileLock | None = None
        self._made_run_folder = False

    def acquire(self) -> CheckpointDirLock:
        # Only the run dir's own checkpoints/ is removed again when unused: a user's checkpoint.dir stays.
        self._made_run_folder = not self.root.exists() and self.root == Path(self.run_dir) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.root / LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise ConfigError("checkpoint.dir", f"{self.root} is in use by {self._owner()}",
                              "give each job its own checkpoint.dir (the default, <run dir>/checkpoints, is "
                              "one per run), or wait for that job to end") from None
        self._lock = lock
        write_json_atomic(self.root / OWNER_FILE, {"run_dir": self.run_dir, "pid": os.getpid(),
                                                   "host": socket.gethostname(), "since": time.time()})
        return self

    def _owner(self) -> str:
        try:
            owner = json.loads((self.root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            return "another job"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        return f"the job in {owner.get('run_dir')} (pid {owner.get('pid')} on {owner.get('host')}, since {since})"

    def release(self) -> None:
        if self._lock is not None:
            (self.root / OWNER_FILE).unlink(missing_ok=True)
            if self._made_run_folder:
                self._remove_unused_root()
            self._lock.release()
            self._lock = None

    def _remove_unused_root(self) -> None:
        """Remove the run dir's checkpoints/ this lock made when the job saved nothing into it; done while the lock
        is held, so a job opening the lock file meanwhile is refused."""
        try:
            if {p.name for p in self.root.iterdir()} <= {LOCK_FILE}:
                (self.root / LOCK_FILE).unlink(missing_ok=True)
                self.root.rmdir()
        except OSError:
            pass  # something arrived meanwhile: the folder stays

    def __enter__(self) -> CheckpointDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def job_lock(checkpoint: Checkpoint, run_dir: str | Path) -> AbstractContextManager:
    """The lock a job holds while it runs: on its checkpoint dir when it will save there, else none."""
    if checkpoint.every_n_steps > 0 or checkpoint.final or checkpoint.on_signal:
        return CheckpointDirLock(checkpoint_root(checkpoint.dir, Path(run_dir)), run_dir)
    return nullcontext()

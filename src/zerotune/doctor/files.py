"""The files a run touches: the NVMe offload folder, the torch extensions cache's locks, and accelerate's
default config."""

from __future__ import annotations

import contextlib
import shutil
import sys
from typing import Any

from zerotune import config_search
from zerotune.doctor.check import FAIL, INFO, OK, WARN, Check
from zerotune.errors import ConfigError
from zerotune.folders import fs_type, nearest_existing
from zerotune.ops import locks
from zerotune.schema import Config
from zerotune.units import MIB


def offload_path_check(path: str | None, cfg: Config, overrides: list[str]) -> Check:
    """Can files be created there, and is there room: for the composed config's NVMe swap where it uses one
    (the planner's prediction), else the free space alone."""
    from zerotune.ds_config.offload import check_nvme_path

    if not path:
        return Check("offload path", INFO, f"none set (offload={cfg.offload.device}); to check one: --offload-path "
                     "PATH, or offload=nvme offload.path=PATH")
    try:
        folder = check_nvme_path(path, "offload.path")
    except ConfigError as exc:
        return Check("offload path", FAIL, exc.problem, exc.fix, {"path": path})
    existing = nearest_existing(folder)
    free = shutil.disk_usage(existing).free
    facts = {"path": str(folder), "free_bytes": free, "file_system": fs_type(existing)}
    found = f"{folder} is writable, {_size(free / MIB)} free ({facts['file_system'] or 'unknown'} file system)"
    need = _nvme_need_mib(overrides) if cfg.offload.device == "nvme" else None
    facts["needed_mib"] = need
    if need is not None and free < need * MIB:
        return Check("offload path", FAIL, f"{found}: the run swaps about {_size(need)} there",
                     "free space there, or point offload.path at a larger disk (ideally local NVMe)", facts)
    if need is not None:
        found += f"; the run swaps about {_size(need)} there"
    if facts["file_system"] in ("tmpfs", "ramfs"):
        return Check("offload path", WARN, f"{found}; it is in memory, so swapping there saves no host memory",
                     "point offload.path at a disk, ideally local NVMe", facts)
    return Check("offload path", OK, found, details=facts)


def _size(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def _nvme_need_mib(overrides: list[str]) -> float | None:
    """What the planner predicts the run writes to the NVMe folder; None where the config cannot be planned."""
    from zerotune.compose import compose_settled
    from zerotune.plan.predict import predict
    from zerotune.preflight import check

    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
            run = check(compose_settled(overrides))
            return predict(run, None).nvme_mib
    except ConfigError:
        return None


def locks_check(remove: bool) -> Check:
    """Locks in the torch extensions cache; with `remove`, the provably stale ones are deleted."""
    root = locks.extensions_root()
    states = locks.inspect(locks.find_locks(root))
    if remove:  # settle with no wait: removes a stale one in turn with starting jobs, leaves the rest
        states = [locks.settle(s.path, timeout_s=0) if s.state == "stale" else s for s in states]
    facts = {"root": str(root), "locks": [{"path": str(s.path), "state": s.state, "pids": s.pids,
                                           "reason": s.reason} for s in states]}
    stale = [s for s in states if s.state == "stale"]
    undecided = [s for s in states if s.state == "undecided"]
    if stale or undecided:
        fixes = []
        if stale:
            fixes.append(f"rm {' '.join(str(s.path) for s in stale)} (safe: no process has it open), or run "
                         "this with --fix; zerotune jobs also remove stale locks when they start")
        if undecided:
            fixes.append("it is safe to delete when no DeepSpeed op build is running: "
                         f"rm {' '.join(str(s.path) for s in undecided)}")
        return Check("locks", WARN, "; ".join(s.describe() for s in stale + undecided)
                     + "; any DeepSpeed load of that op waits on it forever", "; ".join(fixes), facts)
    others = [s.describe() for s in states if s.state in ("held", "removed")]
    summary = "; ".join(others) if others else f"no lock in {root}"
    return Check("locks", OK, summary, details=facts)


def accelerate_check() -> Check:
    """The accelerate config zerotune would read with accelerate.config_file=auto: `accelerate launch`'s
    environment, else the file at accelerate's default location."""
    from zerotune.user_config import accelerate_config as ac

    default = ac.default_location()
    try:
        found = ac.find("auto")
    except ConfigError as exc:
        return Check("accelerate", FAIL, f"{default}: {exc.problem} (runs with accelerate.config_file=auto "
                     "stop on it)", f"{exc.fix}; or ignore it with accelerate.config_file=null", {"path": str(default)})
    if not found:
        return Check("accelerate", OK, f"no default config ({default} does not exist): zerotune's own settings "
                     "apply", details={"path": str(default)})
    described = "; ".join(_describe(c) for c in found)
    return Check("accelerate", INFO, f"{described}: zerotune runs take these settings (accelerate.config_file"
                 "=auto; =null ignores them)", details={"configs": [c.__dict__ for c in found]})


def configs_check() -> Check:
    """Where `zerotune train` (and every command) finds configs, in the order Hydra searches them."""
    search = config_search.current()
    packaged = ", ".join(str(folder) for folder in search.folders()[1 if search.user else 0:])
    details = {**search.describe(), "folders": [str(folder) for folder in search.folders()]}
    if search.user is None:
        return Check("configs", OK, f"packaged only: {packaged} (no ./zerotune/ here; --config-dir DIR names "
                     "another folder of yours)", details=details)
    where = f"yours first: {search.user.path} ({search.user.how}); then packaged: {packaged}"
    shadowed = search.shadowed()
    if shadowed:
        names = ", ".join(str(mine.relative_to(search.user.path)) for mine, _ in shadowed)
        return Check("configs", WARN, f"{where}; yours hide packaged files of the same name: {names}",
                     "rename yours (e.g. optimizer/my_adamw.yaml, used as optimizer=my_adamw) to keep both", details)
    return Check("configs", OK, where, details=details)


def _describe(c: Any) -> str:
    ds = c.deepspeed
    fields = [f"{k} {ds[k]}" for k in ("zero_stage", "offload_optimizer_device", "offload_param_device",
                                       "deepspeed_config_file") if ds.get(k) not in (None, "none")]
    fields += [f"mixed_precision {c.mixed_precision}"] if c.mixed_precision else []
    fields += [f"{k} {v}" for k, v in c.machines.items()]
    where = c.path if c.path else c.origin
    return f"{where} ({c.distributed_type or 'NO'}{', ' if fields else ''}{', '.join(fields)})"

"""`zerotune doctor`'s checks (the files a run touches, and the machine: platform, build tools, DeepSpeed's ops,
libaio, GPUs) and their report as text or JSON. Nothing here builds an op or creates a CUDA context."""

from __future__ import annotations

import contextlib
import json
import os
import platform as _platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zerotune.config import search as config_search
from zerotune.config.errors import ConfigError
from zerotune.config.schema import MIB, Config
from zerotune.host import ops_locks
from zerotune.host.ops import COMPILER_FIX
from zerotune.host.platform import fs_type, nearest_existing

OK, INFO, WARN, FAIL = "OK", "INFO", "WARN", "FAIL"
PROBLEMS = (WARN, FAIL)


@dataclass
class Check:
    name: str
    status: str                 # OK | INFO | WARN | FAIL
    summary: str                # one line: what was found
    fix: str = ""               # for a WARN or FAIL: what to do about it
    details: dict = field(default_factory=dict)  # the facts behind the line, for --json

    def __post_init__(self) -> None:
        if self.status in PROBLEMS and not self.fix:
            raise ValueError(f"check {self.name}: a {self.status} needs its fix")


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def as_text(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.summary}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (FAIL, WARN)}
    lines.append(f"{counts[FAIL]} failed, {counts[WARN]} warning(s)")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> str:
    # "failed": how many checks failed (doctor's own words, not a run's status)
    return json.dumps({"checks": [asdict(c) for c in checks], "failed": sum(c.status == FAIL for c in checks),
                       "warnings": sum(c.status == WARN for c in checks)}, indent=2, default=str)


def offload_path_check(path: str | None, cfg: Config, overrides: list[str]) -> Check:
    """Can files be created there, and is there room: for the composed config's NVMe swap where it uses one
    (the planner's prediction), else the free space alone."""
    from zerotune.plan.deepspeed import check_nvme_path

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
    from zerotune.config.compose import compose_settled
    from zerotune.plan.predict import predict
    from zerotune.plan.resolve import check

    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
            run = check(compose_settled(overrides))
            return predict(run, None).nvme_mib
    except ConfigError:
        return None


def locks_check(remove: bool) -> Check:
    """Locks in the torch extensions cache; with `remove`, the provably stale ones are deleted."""
    root = ops_locks.extensions_root()
    states = ops_locks.inspect(ops_locks.find_locks(root))
    if remove:  # settle with no wait: removes a stale one in turn with starting jobs, leaves the rest
        states = [ops_locks.settle(s.path, timeout_s=0) if s.state == "stale" else s for s in states]
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
    from zerotune.config import accelerate_file

    default = accelerate_file.default_location()
    try:
        found = accelerate_file.find("auto")
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


# The ops zerotune's own options load (host/ops.py), and what needs each.
USED_FOR = {"cpu_adam": "offload=cpu|nvme with adam/adamw", "cpu_adagrad": "offload with optimizer=adagrad",
            "cpu_lion": "offload with optimizer=lion", "async_io": "offload=nvme", "pin_memory": "offload=nvme",
            "deepspeed_shm_comm": "several processes on the CPU accelerator"}
SETUP_FIX = "pip install deepspeed==0.19.8 into this environment (make setup does it)"
LIBAIO_FIX = ("install libaio: apt-get install libaio-dev (Debian/Ubuntu), yum install libaio-devel (RHEL); "
              "or offload=cpu / offload=none instead of NVMe")


def platform_check() -> Check:
    import torch

    from zerotune.host import platform

    found = platform.detect()
    facts = {"os": _platform.platform(), "python": _platform.python_version(), "torch": torch.__version__}
    where = f"{facts['os']}, python {facts['python']}, torch {facts['torch']}"
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        facts.update(deepspeed=deepspeed.__version__, accelerator=get_accelerator().device_name())
    except Exception as exc:  # not installed, or its accelerator cannot start (DS_ACCELERATOR=... wrong)
        return Check("platform", FAIL, f"{where}; DeepSpeed cannot start: {exc}".replace("\n", " "),
                     f"{SETUP_FIX}; unset DS_ACCELERATOR if it names a device this machine lacks", facts)
    where += f", deepspeed {facts['deepspeed']}; DeepSpeed's accelerator: {facts['accelerator']}"
    if not found.deepspeed_supported:
        return Check("platform", FAIL, f"{where}; DeepSpeed cannot run here: {found.deepspeed_reason}",
                     "train without DeepSpeed (deepspeed.enabled=false zero_stage=0, plain accelerate), or on "
                     "Linux with an NVIDIA GPU or the CPU", facts)
    if facts["accelerator"] == "cpu" and torch.cuda.is_available():
        return Check("platform", WARN, f"{where}, though torch sees {torch.cuda.device_count()} GPU(s)",
                     "unset DS_ACCELERATOR (or DS_ACCELERATOR=cuda) so that DeepSpeed uses the GPUs", facts)
    how = "on the CPU: every ZeRO stage and offload work, slowly" if facts["accelerator"] == "cpu" else \
        f"on {facts['accelerator']}"
    return Check("platform", OK, f"{where}; DeepSpeed runs here ({how})", details=facts)


def build_tools_check(built: set[str]) -> Check:
    """torch's JIT loader runs ninja on every load, cached or not; the compiler only when it builds."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    facts = {"cxx": _first_line([cxx, "--version"]) if shutil.which(cxx) else None,
             "ninja": _first_line(["ninja", "--version"]) if is_ninja_available() else None}
    found = f"C++ compiler {cxx}: {facts['cxx'] or 'missing'}; ninja: {facts['ninja'] or 'missing'}"
    if facts["ninja"] is None:
        return Check("build tools", FAIL, f"{found} (every DeepSpeed op load runs it)", COMPILER_FIX, facts)
    if facts["cxx"] is None:
        missing = sorted(set(USED_FOR) - built)
        status = FAIL if {"cpu_adam", "deepspeed_shm_comm"} - built else WARN
        return Check("build tools", status, f"{found}; ops not built yet cannot be: {', '.join(missing)}",
                     COMPILER_FIX, facts)
    return Check("build tools", OK, found, details=facts)


def op_table() -> dict[str, dict]:
    """ds_report's data: each op of this accelerator, whether it is compatible and whether it is built
    (installed with DeepSpeed, or in the torch extensions cache)."""
    with contextlib.redirect_stdout(sys.stderr):  # builders print their checks
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        root = ops_locks.extensions_root()
        table = {}
        for name, builder in sorted(ALL_OPS.items()):
            if type(builder).__name__ == "NotImplementedBuilder":
                continue
            table[name] = {"compatible": bool(builder.is_compatible(verbose=False)),
                           "installed": bool(installed_ops.get(name, False)), "cached": _cached(root, name)}
    return table


def _cached(root: Path, name: str) -> bool:
    # torch names the library <op>.so, or <op>_v<N>.so once the op's sources or flags changed.
    folder = root / name
    return folder.is_dir() and any(p.suffix == ".so" and p.name.startswith(name) for p in folder.iterdir())


def ops_check(table: dict[str, dict]) -> Check:
    built = sorted(n for n, op in table.items() if op["installed"] or op["cached"])
    ready = sorted(n for n, op in table.items() if op["compatible"] and n not in built)
    broken = sorted(n for n, op in table.items() if not op["compatible"])
    parts = [f"built: {', '.join(built) or 'none'}", f"compatible, built on first use: {', '.join(ready) or 'none'}"]
    if broken:
        parts.append(f"incompatible: {', '.join(broken)}")
    summary = f"{len(table)} DeepSpeed ops; " + "; ".join(parts)
    needed = [n for n in broken if n in USED_FOR and n not in ("async_io", "pin_memory")]  # libaio's line
    if needed:
        uses = "; ".join(f"{n} ({USED_FOR[n]})" for n in needed)
        return Check("ops", WARN, summary, f"these cannot be built here: {uses}; run `ds_report` for why, "
                     "or choose options that do not need them", {"ops": table})
    return Check("ops", OK, summary, details={"ops": table})


def libaio_check(table: dict[str, dict], nvme_wanted: bool) -> Check:
    """DeepSpeed's own test (async_io's is_compatible compiles and links a call to io_submit), and the
    Debian package the Makefile installs, where dpkg exists."""
    compatible = table.get("async_io", {}).get("compatible", False)
    package = None
    if shutil.which("dpkg"):
        package = subprocess.run(["dpkg", "-s", "libaio-dev"], capture_output=True).returncode == 0
    said = {None: "", True: "libaio-dev installed; ", False: "libaio-dev not installed; "}[package]
    facts = {"async_io_compatible": compatible, "libaio_dev_package": package}
    if compatible:
        return Check("libaio", OK, f"{said}DeepSpeed links against libaio: NVMe offload (async_io) can be built",
                     details=facts)
    status = FAIL if nvme_wanted else WARN
    return Check("libaio", status, f"{said}DeepSpeed cannot link against libaio: NVMe offload (offload=nvme) "
                 "is not possible", LIBAIO_FIX + "; if it is installed elsewhere, set CFLAGS=-I... LDFLAGS=-L...",
                 facts)


def gpus_check() -> Check:
    import torch

    if torch.cuda.is_available():
        gpus = [_gpu(i) for i in range(torch.cuda.device_count())]
        listed = "; ".join(f"{g['index']}: {g['name']}, {g['free_mib'] / 1024:.1f} of {g['total_mib'] / 1024:.1f} "
                           "GiB free" for g in gpus)
        return Check("gpus", OK, f"{len(gpus)} visible: {listed}", details={"gpus": gpus})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is None and shutil.which("nvidia-smi"):
        return Check("gpus", WARN, f"an NVIDIA driver is installed, but torch {torch.__version__} is a CPU-only "
                     "build", "install a CUDA build of torch (make setup TORCH='torch==<version>' with the CUDA "
                     "wheel index)", {"gpus": []})
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
    elif visible is not None and visible.strip() in ("", "-1"):
        why = f"CUDA_VISIBLE_DEVICES={visible!r} hides them"
    else:
        why = "no NVIDIA GPU or driver found"
    return Check("gpus", INFO, f"none visible ({why}): DeepSpeed runs on the CPU accelerator", details={"gpus": []})


def _gpu(index: int) -> dict:
    """Name and memory from NVML (no CUDA context); from torch where NVML is missing."""
    from zerotune.host.memory import Nvml

    nvml = Nvml(index)
    if nvml.ok:
        p, handle = nvml.pynvml, nvml.handle
        memory = p.nvmlDeviceGetMemoryInfo(handle)
        name = p.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        free, total = int(memory.free), int(memory.total)
    else:
        import torch

        name = torch.cuda.get_device_name(index)
        free, total = torch.cuda.mem_get_info(index)
    return {"index": index, "name": name, "free_mib": free / 2**20, "total_mib": total / 2**20}


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if out.returncode == 0 and lines else None

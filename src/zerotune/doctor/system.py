"""The machine: platform and DeepSpeed's accelerator, build tools, DeepSpeed's ops (ds_report's data), libaio,
and the GPUs. Nothing here builds an op or creates a CUDA context."""

from __future__ import annotations

import os
import platform as _platform
import shutil
import subprocess
import sys
from pathlib import Path

from zerotune.doctor.check import FAIL, INFO, OK, WARN, Check
from zerotune.ops import locks
from zerotune.ops.build import COMPILER_FIX

# The ops zerotune's own options load (ops/build.py), and what needs each.
USED_FOR = {"cpu_adam": "offload=cpu|nvme with adam/adamw", "cpu_adagrad": "offload with optimizer=adagrad",
            "cpu_lion": "offload with optimizer=lion", "async_io": "offload=nvme", "pin_memory": "offload=nvme",
            "deepspeed_shm_comm": "several processes on the CPU accelerator"}
SETUP_FIX = "pip install deepspeed==0.19.8 into this environment (make setup does it)"
LIBAIO_FIX = ("install libaio: apt-get install libaio-dev (Debian/Ubuntu), yum install libaio-devel (RHEL); "
              "or offload=cpu / offload=none instead of NVMe")


def platform_check() -> Check:
    import torch

    from zerotune import platform as zplatform

    found = zplatform.detect()
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
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # builders print their checks
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        root = locks.extensions_root()
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
    from zerotune.telemetry.nvml import Nvml

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

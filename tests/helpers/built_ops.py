"""DeepSpeed's JIT ops in the torch extensions cache: whether they are built and current, and their build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import ROOT, cli_env

# What a ZeRO-2 offload=cpu job with DeepSpeed's AdamW loads, on the CPU accelerator, in load order.
ADAM_CPU_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                    "optimizer": {"type": "AdamW", "params": {}}}
OFFLOAD_CPU_OPS = ["deepspeed_shm_comm", "cpu_adam"]


def is_current(folder: Path) -> bool:
    """The op's library is there and ninja has nothing to rebuild: a loader of it (or of a copy) compiles nothing."""
    ninja = shutil.which("ninja")
    if ninja is None or not (folder / f"{folder.name}.so").is_file():
        return False
    dry = subprocess.run([ninja, "-C", str(folder), "-n"], capture_output=True, text=True, timeout=60)
    return "no work to do" in dry.stdout


def build_offload_ops(root: Path) -> None:
    """Build (or load) the offload=cpu ops into `root` as a job's parent does (host/ops.py), in a process of its
    own: minutes on a fresh cache."""
    code = ("import logging\nlogging.basicConfig(level=logging.INFO)\n"
            f"from zerotune.host.ops import prebuild_ops\nprebuild_ops({ADAM_CPU_OFFLOAD!r}, True)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**cli_env(), "TORCH_EXTENSIONS_DIR": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]

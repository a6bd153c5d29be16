"""py-cpuinfo's answer about this CPU, found once per CPU rather than at every DeepSpeed op load.

DeepSpeed's CPU op builders (`cpu_arch`, `simd_width`) and CPU-Adam's constructor each call
`cpuinfo.get_cpu_info()`, and py-cpuinfo answers each call by starting a new Python interpreter to run its probe:
1.2 s of CPU per call on the 2-core development host, five calls in an `offload=cpu` worker and as many in its
job's parent. The answer depends on the CPU alone, so `remember_cpu_info()` keeps it in the process and in
zerotune's cache folder, keyed by the CPU's identity (/proc/cpuinfo's vendor, family, model, stepping and flags,
the core count and py-cpuinfo's version), and points py-cpuinfo's function at it. DeepSpeed imports the function
inside each call (`from cpuinfo import get_cpu_info`), so replacing the module's attribute is what it sees; py-cpuinfo
has no cache of its own to turn on, hence this one.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerotune import files

CACHE_FILE = "cpu_info_v1.json"
_IDENTITY_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def cpu_identity(proc_cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """What the answer depends on, hashed; None where /proc/cpuinfo cannot be read (then only the process keeps
    it). The lines that change while the host runs (MHz, bogomips) are left out."""
    try:
        text = proc_cpuinfo.read_text()
    except OSError:
        return None
    lines = sorted({line.strip() for line in text.splitlines()
                    if line.split(":", 1)[0].strip() in _IDENTITY_FIELDS})
    import cpuinfo

    lines += [f"cores={os.cpu_count()}", f"machine={platform.machine()}", f"py-cpuinfo={cpuinfo.CPUINFO_VERSION_STRING}"]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _usable(answer: Any) -> bool:
    return isinstance(answer, dict) and isinstance(answer.get("arch"), str) and isinstance(answer.get("flags"), list)


@functools.cache
def cached_cpu_info(ask: Callable[[], dict]) -> dict:
    """py-cpuinfo's answer: from the cache when this CPU's is there, else `ask`ed once and kept."""
    identity = cpu_identity()
    file = files.cache_dir("ops") / CACHE_FILE
    known = files.read_json(file) if identity is not None else None
    known = known if isinstance(known, dict) else {}
    if identity is not None and _usable(known.get(identity)):
        return known[identity]
    answer = ask()
    if identity is not None and _usable(answer):
        files.write_cached_json(file, {**known, identity: answer})
    return answer


def remember_cpu_info() -> None:
    """Point `cpuinfo.get_cpu_info` at the cached answer, in this process, before DeepSpeed loads its ops."""
    import cpuinfo

    if hasattr(cpuinfo.get_cpu_info, "__wrapped__"):  # done already in this process
        return
    ask = cpuinfo.get_cpu_info

    @functools.wraps(ask)
    def get_cpu_info() -> dict:
        return copy.deepcopy(cached_cpu_info(ask))  # a caller that edits its answer cannot change the next one's

    cpuinfo.get_cpu_info = get_cpu_info

"""The environment of DeepSpeed's JIT op builds: a shell-safe link to torch's libraries (build.ninja passes link flags
to the shell unquoted, so a path with a space fails with `ld: cannot find -lc10`), and py-cpuinfo's answer cached per
CPU (py-cpuinfo has no cache and starts an interpreter per call: 1.2 s of CPU each, five per offload=cpu worker)."""

from __future__ import annotations

import contextlib
import copy
import functools
import getpass
import hashlib
import logging
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerotune.config import files
from zerotune.config.errors import ConfigError

log = logging.getLogger("zerotune")

KEY = "TORCH_EXTENSIONS_DIR"
# shlex.quote's safe characters, letters and digits of any script included (the shell splits none of them).
SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+")


def extensions_root() -> Path:
    """The folder torch builds extensions in, as its _get_build_directory computes it (without creating it)."""
    explicit = os.environ.get(KEY)
    if explicit is not None:
        return Path(explicit)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    return Path(get_default_build_root()) / tag


def shell_safe(path: str | Path) -> bool:
    return SHELL_SAFE.fullmatch(str(path)) is not None


def torch_lib() -> str:
    """torch's library folder, as cpp_extension.TORCH_LIB_PATH spells it before any link replaces it."""
    import torch

    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")


def link_torch_lib(lib: str | None = None, root: Path | None = None) -> str | None:
    """Where torch's library folder `lib` has a character the shell splits on, make this process's JIT builds link
    through `<extensions root>/.torch-lib-<hash>`; that path, or None. Every process that loads an op must call it
    (each rewrites build.ninja, and ninja relinks when the link line changed)."""
    from torch.utils import cpp_extension

    lib = lib or torch_lib()
    if shell_safe(lib) or sys.platform == "win32":  # on Windows torch quotes the link flags itself
        return None
    root = root or extensions_root()
    # Named after the folder it stands for: torch installs sharing one cache never take each other's link.
    link = root / f".torch-lib-{hashlib.sha256(os.path.realpath(lib).encode()).hexdigest()[:12]}"
    if not shell_safe(link):
        raise ConfigError(KEY, f"{_problem(lib)}; zerotune links to that folder from the torch extensions cache, "
                          f"but the cache's path {str(root)!r} has such a character too", _fix())
    try:
        _point(link, os.path.realpath(lib))
    except OSError as exc:
        raise ConfigError(KEY, f"{_problem(lib)}; zerotune could not link to that folder from the torch "
                          f"extensions cache: {exc}", f"make {root} writable, or {_fix()}") from exc
    if cpp_extension.TORCH_LIB_PATH != str(link):
        log.info("torch's library folder %r has a character the shell splits on: DeepSpeed's ops link "
                 "through %s", lib, link)
    cpp_extension.TORCH_LIB_PATH = str(link)  # read by cpp_extension._prepare_ldflags at each build
    return str(link)


def _point(link: Path, target: str) -> None:
    """`link` -> `target`, made beside it and renamed over it: processes doing this at once never see a half
    made link (os.symlink alone fails where one exists; no library helper replaces a link atomically)."""
    if link.is_symlink() and os.readlink(link) == target:
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    made = link.with_name(f"{link.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        made.unlink()
    try:
        os.symlink(target, made)
        os.replace(made, link)
    finally:
        with contextlib.suppress(FileNotFoundError):
            made.unlink()


def _problem(lib: str) -> str:
    return (f"torch's library folder {lib!r} has a space or a shell character, and torch's JIT build of "
            "DeepSpeed's ops passes it to the linker unquoted (ld: cannot find -lc10)")


def _fix() -> str:
    home = Path.home() / ".cache" / "torch_extensions"
    example = home if shell_safe(home) else Path(tempfile.gettempdir()) / f"torch_extensions_{getpass.getuser()}"
    return (f"set {KEY} to a folder whose path has no spaces or shell characters, e.g. "
            f"export {KEY}={example}")


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
    """Point `cpuinfo.get_cpu_info` at the cached answer, in this process, before DeepSpeed loads its ops (DeepSpeed
    imports the function inside each call, so it sees the replacement)."""
    import cpuinfo

    if hasattr(cpuinfo.get_cpu_info, "__wrapped__"):  # done already in this process
        return
    ask = cpuinfo.get_cpu_info

    @functools.wraps(ask)
    def get_cpu_info() -> dict:
        return copy.deepcopy(cached_cpu_info(ask))  # a caller that edits its answer cannot change the next one's

    cpuinfo.get_cpu_info = get_cpu_info

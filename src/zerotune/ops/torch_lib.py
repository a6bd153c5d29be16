"""The torch extensions cache, where DeepSpeed's JIT ops are built, and the path to torch's libraries that
their builds link against.

torch.utils.cpp_extension writes each op's build.ninja with its compile flags quoted but its link flags not
(`ldflags = -shared -L<torch>/lib -lc10 ...`), and ninja hands them to the shell. Installed under a path with
a space (a virtual environment in "my project/venv"), torch's `-L` splits in two and every op fails to link
(`ld: cannot find -lc10`), however complete the compiler. The builds are pointed at a link to that folder
in the extensions cache instead, whose path has nothing the shell would split.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

from zerotune.errors import ConfigError

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
    """Where torch's library folder `lib` has a character the shell splits on, make the JIT builds of this
    process link through `<extensions root>/.torch-lib-<hash>`, a link to it; that path, or None where `lib`
    is fine as it is. Every process that loads an op must call it: each writes the op's build.ninja again, and
    ninja relinks when the link line changed."""
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

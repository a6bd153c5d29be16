"""Build zerotune's wheel as a release would: from the tracked files alone, never the working tree's leftovers."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers.cli import ROOT, cli_env


def tracked_files(under: str = ".") -> list[str]:
    """Paths git tracks (symlinks included, as links), relative to the checkout."""
    out = subprocess.run(["git", "ls-files", "-z", "--", under], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [p for p in out.split("\0") if p]


def copy_tracked(dest: Path) -> Path:
    """The tracked files copied to `dest`; links stay links, so src/zerotune/config/conf still points at conf/."""
    for relative in tracked_files():
        source = ROOT / relative
        if not source.is_symlink() and not source.exists():  # deleted in the working tree, not yet committed
            continue
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


def build_wheel(tmp: Path) -> Path:
    """The wheel built from a copy of the tracked files under `tmp` (its build/ stays in the copy)."""
    source, out = copy_tracked(tmp / "source"), tmp / "dist"
    env = cli_env()
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(source), "-w", str(out)], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = sorted(out.glob("zerotune-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()

"""`make gpu-kit`'s wheels install offline (--no-index) over a stand-in of the GPU machine's image, and everything
the kit runs imports from them. Slow: it builds the kit twice (downloads from the package index).

Python versions: the kit is for the card's CPython 3.12; this machine's is 3.11, and no CPU torch wheel for 3.12
is here to make a 3.12 stand-in. So the test checks the 3.12 kit's names and tags, builds its 3.11 twin with the
same pins (build_kit.sh DEST 3.11: the binary wheels, pydantic-core and sqlalchemy, become their cp311 builds; the pure ones
are the same files), and installs that twin into a fresh 3.11 venv whose image packages (torch and the rest of
benchmarks/gpu/image_packages.txt) are linked from this venv through a .pth file, as --system-site-packages would
give them, while everything the image lacks is left out: it must come from the kit."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import ROOT, cli_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

KIT = ROOT / "benchmarks" / "gpu"
LIMIT = 64 * 2**20
IMPORTS = ["deepspeed", "diffusers", "hydra", "omegaconf", "antlr4", "pydantic", "pydantic_core", "hjson",
           "importlib_metadata", "annotated_types", "typing_inspection", "optuna", "sqlalchemy", "alembic", "mako",
           "colorlog", "zerotune"]
# what the kit's parts import on the card: the trainer, planner, folder data, export, and the benchmark scripts
ALSO = ["zerotune.cli.train", "zerotune.train.run", "zerotune.cli.plan", "zerotune.data.components",
        "zerotune.rundir.export", "deepspeed.ops.adam", "diffusers.models.autoencoders", "hydra_plugins.zerotune_user_configs"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    lines = [ln.split("#")[0].split() for ln in (KIT / "requirements.txt").read_text().splitlines()]
    split = (pin.split("==") for _, pin, *_ in (ln for ln in lines if ln))
    return {norm(name): version for name, version in split}


def build(dest: Path, python: str) -> list[Path]:
    proc = subprocess.run(["bash", str(KIT / "build_kit.sh"), str(dest), python], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu kit: " in proc.stdout
    return sorted(dest.glob("*.whl"))


def wheel_name(path: Path) -> tuple[str, str, str]:
    """(name, version, the tags after them) of a wheel's file name."""
    name, version, tags = path.name.removesuffix(".whl").split("-", 2)
    return norm(name), version, tags


def image_closure(kit: set[str]) -> set[str]:
    """The image's packages and what they need here (this venv's versions of them need more than the card's:
    huggingface-hub 2 needs httpx2), less what the kit carries: those must come from the kit."""
    from packaging.requirements import Requirement

    lines = (KIT / "image_packages.txt").read_text().splitlines()
    todo = [word for line in lines if not line.startswith("#") for word in line.split()]
    seen: set[str] = set()
    while todo:
        name = norm(todo.pop())
        if name in seen or name in kit:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def image_standin(folder: Path, kit: set[str]) -> Path:
    """Links to this venv's copies of the image's packages (files and .dist-info), nothing else."""
    image = image_closure(kit)
    folder.mkdir()
    for dist in md.distributions():
        if norm(dist.metadata["Name"]) not in image:
            continue
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return folder


def test_the_kit_installs_offline_and_imports(tmp_path):
    kit312 = build(tmp_path / "kit312", "3.12")
    assert sum(p.stat().st_size for p in kit312) < LIMIT
    names = {wheel_name(p)[0]: wheel_name(p) for p in kit312}
    assert {n: v for n, (_, v, _) in names.items() if n != "zerotune"} == pins()
    assert names["zerotune"][1] == "0.1.0"
    binary = {n for n, (_, _, tag) in names.items() if tag != "py3-none-any"}
    assert binary == {"pydantic-core", "sqlalchemy"}
    assert all("cp312-cp312-manylinux" in names[n][2] for n in binary)

    kit311 = build(tmp_path / "kit311", "3.11")
    assert {p.name for p in kit311 if "none-any" in p.name} == {p.name for p in kit312 if "none-any" in p.name}

    venv, site = tmp_path / "venv", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    packages = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    (Path(packages) / "gpu_image.pth").write_text(str(image_standin(tmp_path / "image", set(names))) + "\n")
    env = {k: v for k, v in cli_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", str(site), *map(str, kit311)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_imports(py, {**env, "PYTHONPATH": str(site)}, site, tmp_path)


def check_imports(py: str, env: dict, site: Path, tmp: Path) -> None:
    code = ("import importlib, json, sys\n"
            f"mods = {IMPORTS + ALSO!r}\n"
            "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))\n")
    proc = subprocess.run([py, "-c", code], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    for module in IMPORTS:  # from the kit, never from this venv
        assert Path(where[module]).is_relative_to(site), (module, where[module])
    for args in (["ds-config", "zero_stage=3", "offload=cpu"], ["plan", "model=sdxl_tiny", "data=synthetic", "resolution=32", "--json"]):
        proc = subprocess.run([py, "-m", "zerotune", *args], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.lstrip().startswith("{"), proc.stdout[:500]
    assert os.path.isdir(site / "deepspeed" / "ops" / "csrc")  # the sources DeepSpeed JIT-builds its ops from

"""torch installed under a path with a space (a venv in "my proj/venv"): torch.utils.cpp_extension writes the
`-L<torch>/lib` of an op's build.ninja unquoted, so the link fails; zerotune points it at a shell-safe link to
that folder in the extensions cache (host/ops_env.py). Built here for real, with a tiny C++ library."""

from __future__ import annotations

import ctypes
import os
import re
import shlex
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from zerotune.config.errors import ConfigError
from zerotune.host import ops_env

SOURCE = 'extern "C" int zerotune_probe() { return 42; }\n'


@pytest.fixture
def spaced_lib(tmp_path, monkeypatch) -> Path:
    """torch's library folder as a venv under "my proj" would have it: the same files, a path with a space."""
    lib = tmp_path / "my proj" / "torch" / "lib"
    lib.parent.mkdir(parents=True)
    lib.symlink_to(ops_env.torch_lib(), target_is_directory=True)
    monkeypatch.setattr(cpp_extension, "TORCH_LIB_PATH", str(lib))  # what torch there computes for itself
    return lib


def build(name: str, tmp_path: Path) -> str:
    source = tmp_path / f"{name}.cpp"
    source.write_text(SOURCE)
    folder = tmp_path / "build" / name
    folder.mkdir(parents=True)
    return cpp_extension.load(name=name, sources=[str(source)], build_directory=str(folder),
                              is_python_module=False)


def link_flags(name: str, tmp_path: Path) -> list[str]:
    ninja = (tmp_path / "build" / name / "build.ninja").read_text()
    return shlex.split(re.search(r"^ldflags = (.*)$", ninja, re.MULTILINE).group(1))  # as the shell splits it


def test_a_spaced_torch_lib_fails_to_link_as_is_and_links_through_the_cache(spaced_lib, tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="cannot find -lc10"):  # what users met
        build("zerotune_probe_split", tmp_path)
    assert f"-L{spaced_lib}" not in link_flags("zerotune_probe_split", tmp_path)

    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    link = ops_env.link_torch_lib(str(spaced_lib))
    assert link is not None and Path(link).parent == root and ops_env.shell_safe(link)
    assert Path(link).resolve() == Path(ops_env.torch_lib()).resolve()
    assert ops_env.link_torch_lib(str(spaced_lib)) == link  # the next process finds it made

    library = build("zerotune_probe_linked", tmp_path)
    assert f"-L{link}" in link_flags("zerotune_probe_linked", tmp_path)
    assert ctypes.CDLL(library).zerotune_probe() == 42


def test_a_link_left_pointing_elsewhere_is_replaced(spaced_lib, tmp_path):
    root = tmp_path / "torch_extensions"
    link = Path(ops_env.link_torch_lib(str(spaced_lib), root))
    link.unlink()
    link.symlink_to(tmp_path)
    assert ops_env.link_torch_lib(str(spaced_lib), root) == str(link)
    assert link.resolve() == Path(ops_env.torch_lib()).resolve()
    assert [p.name for p in root.iterdir()] == [link.name]  # nothing of the swap left beside it


def test_a_torch_lib_without_spaces_is_left_as_torch_has_it(tmp_path):
    before = cpp_extension.TORCH_LIB_PATH
    assert ops_env.link_torch_lib(str(tmp_path / "venv" / "torch" / "lib"), tmp_path / "cache") is None
    assert cpp_extension.TORCH_LIB_PATH == before and not (tmp_path / "cache").exists()
    assert ops_env.shell_safe("/home/jürgen/über/venv/torch/lib")  # letters of any script are safe


def test_a_cache_with_a_space_too_is_refused_with_a_fix_that_works(spaced_lib, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext cache"))
    with pytest.raises(ConfigError) as refused:
        ops_env.link_torch_lib(str(spaced_lib))
    assert refused.value.key == "TORCH_EXTENSIONS_DIR" and "ext cache" in refused.value.problem
    assert not (tmp_path / "ext cache").exists()

    name, value = re.search(r"export (\w+)=(\S+)$", refused.value.fix).groups()
    monkeypatch.setenv(name, value)  # the fix, as given
    link = ops_env.link_torch_lib(str(spaced_lib))
    assert link is not None and Path(link).parent == tmp_path / "home" / ".cache" / "torch_extensions"
    assert os.path.samefile(link, ops_env.torch_lib())

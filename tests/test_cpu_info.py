"""py-cpuinfo's answer is asked once per CPU (zerotune/host/ops_env.py): DeepSpeed's op builders and CPU-Adam ask
it at every op load, and py-cpuinfo starts a new interpreter for each question (1.2 s of CPU here)."""

from __future__ import annotations

from pathlib import Path

import cpuinfo
import pytest

from zerotune.host import ops_env

CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
stepping\t: 6
cpu MHz\t\t: {mhz}
flags\t\t: fpu sse avx2 {extra}
bogomips\t: {bogo}
"""


def proc_file(tmp_path: Path, name: str, mhz: str = "2900.000", bogo: str = "5800.00", extra: str = "") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(CPUINFO.format(n=n, mhz=mhz, bogo=bogo, extra=extra) for n in range(2)))
    return path


def test_the_identity_ignores_what_changes_while_the_host_runs(tmp_path):
    base = ops_env.cpu_identity(proc_file(tmp_path, "a"))
    assert base is not None
    assert ops_env.cpu_identity(proc_file(tmp_path, "b", mhz="1200.118", bogo="5799.98")) == base
    assert ops_env.cpu_identity(proc_file(tmp_path, "c", extra="avx512f")) != base  # another SIMD width
    assert ops_env.cpu_identity(tmp_path / "absent") is None


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """py-cpuinfo's function replaced by one that counts its calls; zerotune's cache in an empty folder."""
    calls = []

    def ask() -> dict:
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "fma"], "vendor_id_raw": "GenuineIntel"}

    monkeypatch.setenv("ZEROTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)  # restored afterwards, over what remember_cpu_info put there
    ops_env.cached_cpu_info.cache_clear()
    yield calls
    ops_env.cached_cpu_info.cache_clear()


def test_the_cpu_is_asked_once_then_read_from_the_cache(counted, tmp_path):
    ops_env.remember_cpu_info()
    ops_env.remember_cpu_info()  # a second call does not wrap the wrapper
    first = cpuinfo.get_cpu_info()
    first["flags"].append("edited by a caller")
    assert cpuinfo.get_cpu_info()["flags"] == ["avx2", "fma"] and len(counted) == 1
    assert (tmp_path / "cache" / "ops" / ops_env.CACHE_FILE).exists()

    ops_env.cached_cpu_info.cache_clear()  # as a new process starts: the file answers
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(counted) == 1


def test_an_unreadable_cache_is_asked_again(counted, tmp_path):
    file = tmp_path / "cache" / "ops" / ops_env.CACHE_FILE
    file.parent.mkdir(parents=True)
    file.write_text('{"truncated": ')
    ops_env.remember_cpu_info()
    assert cpuinfo.get_cpu_info()["flags"] == ["avx2", "fma"] and len(counted) == 1


def test_deepspeeds_builders_read_the_cached_answer(counted):
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    ops_env.remember_cpu_info()
    builder = CPUAdamBuilder()
    assert builder.cpu_arch() == "-march=native" and builder.simd_width() == "-D__AVX256__"  # avx2 in the flags
    assert len(counted) == 1  # two builder questions, one answer

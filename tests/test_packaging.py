"""The wheel built from the tracked files carries everything an installed zerotune reads: the configs, the
experiments, the Hydra plugin, the builder page, the `zerotune` command; and none of the checkout's results."""

from __future__ import annotations

import configparser
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.helpers.cli import ROOT
from tests.helpers.wheel import build_wheel, tracked_files, wheel_names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def names(wheel) -> set[str]:
    return set(wheel_names(wheel))


def shipped_as(checkout_files: list[str], prefix: str, package: str) -> dict[str, str]:
    """{checkout path: the wheel path it must have} for files under `prefix` shipped inside `package`."""
    assert checkout_files, f"nothing tracked under {prefix}"
    return {f: f"{package}/{PurePosixPath(f).relative_to(prefix)}" for f in checkout_files}


def test_every_config_ships_with_its_content(wheel, names):
    yamls = [f for f in tracked_files("conf") if f.endswith(".yaml")]
    expected = shipped_as(yamls, "conf", "zerotune/config/conf")
    assert sorted(set(expected.values()) - names) == []
    assert "zerotune/config/conf/config.yaml" in names and "zerotune/config/conf/hydra/launcher/slurm.yaml" in names
    with zipfile.ZipFile(wheel) as zf:  # the files the links point at, not stale copies
        assert all(zf.read(inside) == (ROOT / f).read_bytes() for f, inside in expected.items())


def test_every_packaged_experiment_ships(names):
    yamls = [f for f in tracked_files("experiments/experiment") if f.endswith(".yaml")]
    expected = shipped_as(yamls, "experiments/experiment", "zerotune/config/experiments/experiment")
    assert sorted(set(expected.values()) - names) == []


def test_the_config_packages_and_the_hydra_plugin_ship(names):
    # importlib.resources and Hydra's pkg:// find the configs as packages
    assert {"zerotune/config/conf/__init__.py", "zerotune/config/experiments/__init__.py",
            "hydra_plugins/zerotune_user_configs/__init__.py"} <= names


def test_every_module_and_the_builder_page_ship(names):
    expected = shipped_as(tracked_files("src"), "src", ".")
    missing = sorted(inside.removeprefix("./") for f, inside in expected.items()
                     if (f.endswith(".py") or "/builder/templates/" in f or "/builder/static/" in f)
                     and inside.removeprefix("./") not in names)
    assert missing == []
    assert any(n.startswith("zerotune/builder/templates/") for n in names)
    assert any(n.startswith("zerotune/builder/static/") for n in names)


def test_the_zerotune_command_is_the_entry_point(wheel, names):
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    with zipfile.ZipFile(wheel) as zf:
        parser.read_string(zf.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"zerotune": "zerotune.cli.command:main"}


def test_only_the_packages_ship_nothing_from_the_checkouts_results(names):
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"zerotune", "hydra_plugins"}
    assert [n for n in names if "results/" in n and not n.startswith("zerotune/builder/")] == []
    assert [n for n in names if n.startswith(("zerotune/config/experiments/results", "experiments/"))] == []

"""The user's own configs beside the packaged ones: ./zerotune/ in the working directory, or --config-dir."""

from __future__ import annotations

import json
import logging

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import call_main, run_cli
from zerotune.cli.doctor import main as doctor_main
from zerotune.cli.doctor_checks import configs_check
from zerotune.config import search as config_search
from zerotune.config.compose import compose
from zerotune.config.errors import ConfigError

MINE = """# @package _global_
defaults:
  - override /data: synthetic
train:
  max_steps: 2
  batch_size: 4
"""


def user_folder(root, lr: float = 0.123, shadow: bool = False):
    """A folder of configs as a user writes one: an experiment and an optimizer option of their own."""
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text(MINE)
    (root / "optimizer").mkdir()
    adamw = (config_search.packaged_conf() / "optimizer" / "adamw.yaml").read_text()
    mine = adamw.replace("lr: 1.0e-4", f"lr: {lr}")
    assert mine != adamw
    (root / "optimizer" / "my_adamw.yaml").write_text(mine)
    if shadow:
        (root / "optimizer" / "adamw.yaml").write_text(mine)
    return root


def test_the_working_directorys_zerotune_folder_adds_an_experiment_and_an_option(tmp_path, monkeypatch):
    user_folder(tmp_path / "zerotune")
    monkeypatch.chdir(tmp_path)
    cfg = compose(["experiment=mine", "optimizer=my_adamw"])
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.data.name) == (2, 4, "synthetic")
    assert cfg.optimizer.lr == 0.123 and cfg.optimizer.name == "adamw"
    options = config_search.current().group_options()
    assert "my_adamw" in options["optimizer"] and "adamw" in options["optimizer"]
    assert {"mine", "sdxl_4090_1024_bs8"} <= set(options["experiment"])  # the packaged experiments stay


def test_a_user_option_of_a_packaged_name_is_used_with_a_warning_naming_both(tmp_path, monkeypatch, caplog):
    user_folder(tmp_path / "zerotune", lr=0.5, shadow=True)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="zerotune.config.search"):
        search = config_search.choose_and_warn(None)
    assert compose(["optimizer=adamw", "data=synthetic"]).optimizer.lr == 0.5
    packaged = config_search.packaged_conf() / "optimizer" / "adamw.yaml"
    assert search.shadowed() == [(tmp_path.resolve() / "zerotune" / "optimizer" / "adamw.yaml", packaged)]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and str(tmp_path / "zerotune" / "optimizer" / "adamw.yaml") in warned[0] \
        and str(packaged) in warned[0]
    check = configs_check()
    assert check.status == "WARN" and "optimizer/adamw.yaml" in check.summary and check.fix


def test_an_unknown_option_lists_the_users_options_and_where_to_add_one(tmp_path, monkeypatch):
    user_folder(tmp_path / "zerotune")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        compose(["optimizer=my_adamv"])
    assert err.value.key == "optimizer" and "my_adamw" in err.value.fix
    assert "add zerotune/optimizer/my_adamv.yaml" in err.value.fix
    assert compose(["optimizer=CPUAdam"]).optimizer.name == "adamw"  # DeepSpeed's names still normalise


def test_a_zerotune_package_source_folder_is_not_taken_for_configs(tmp_path, monkeypatch):
    (tmp_path / "zerotune" / "optimizer").mkdir(parents=True)
    (tmp_path / "zerotune" / "__init__.py").write_text("")  # e.g. a checkout's src/, where `zerotune/` is code
    monkeypatch.chdir(tmp_path)
    assert config_search.current().user is None
    assert configs_check().status == "OK" and "packaged only" in configs_check().summary


def test_the_run_records_where_its_configs_came_from(tmp_path, monkeypatch):
    from tests.helpers.cli import preflight

    user_folder(tmp_path / "zerotune")
    monkeypatch.chdir(tmp_path)
    checked = preflight(compose(["experiment=mine"]), overrides=["experiment=mine"])
    configs = checked.config_sources["configs"]
    assert configs["user_folder"] == {"path": str((tmp_path / "zerotune").resolve()),
                                      "how": "found in the working directory"}
    assert configs["search_path"][0] == f"file://{(tmp_path / 'zerotune').resolve()}"
    assert configs["search_path"][1:] == ["pkg://zerotune.config.conf", "pkg://zerotune.config.experiments"]


def test_config_dir_on_the_command_line_from_another_folder(tmp_path):
    mine = user_folder(tmp_path / "my-configs")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli("--config-dir", str(mine), "experiment=mine", "optimizer=my_adamw", "--cfg", "job",
                   cwd=elsewhere, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert (cfg.train.max_steps, cfg.optimizer.lr) == (2, 0.123)


def test_hydras_search_path_shows_the_users_folder_first(tmp_path):
    user_folder(tmp_path / "zerotune")
    proc = run_cli("--info", "searchpath", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "://" in line]
    order = [row.split("|")[2].strip() for row in rows]
    assert order[:4] == ["pkg://hydra.conf", f"file://{(tmp_path / 'zerotune').resolve()}", "pkg://zerotune.config.conf",
                         "pkg://zerotune.config.experiments"]
    assert "zerotune user folder (found in the working directory)" in rows[1]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_config_dir_that_is_not_a_folder_is_a_config_error(tmp_path, how):
    missing = tmp_path / "no-such-folder"
    args, env = (["--config-dir", str(missing)], None) if how == "flag" else ([], {"ZEROTUNE_CONFIG_DIR": str(missing)})
    proc = run_cli(*args, "train.max_steps=1", cwd=tmp_path, env=env, timeout=120)
    key = "--config-dir" if how == "flag" else "ZEROTUNE_CONFIG_DIR"
    assert proc.returncode == 2, proc.stderr
    assert f"config error at `{key}`" in proc.stderr and f"mkdir -p {missing}" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()
    missing.mkdir()  # the fix, applied
    fixed = run_cli(*args, "--cfg", "job", cwd=tmp_path, env=env, timeout=120)
    assert fixed.returncode == 0, fixed.stderr


def test_doctor_prints_the_search_path(tmp_path, monkeypatch):
    user_folder(tmp_path / "zerotune")
    monkeypatch.chdir(tmp_path)
    proc = call_main(doctor_main, "--json")  # the doctor's own process: tests/test_doctor.py
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["configs"]["status"] == "OK"
    assert checks["configs"]["details"]["folders"][0] == str((tmp_path / "zerotune").resolve())
    assert checks["configs"]["details"]["search_path"][1:] == ["pkg://zerotune.config.conf", "pkg://zerotune.config.experiments"]


def test_an_experiment_without_its_package_line_names_the_file_and_the_line_to_add(tmp_path, monkeypatch):
    user_folder(tmp_path / "zerotune")
    bare = tmp_path / "zerotune" / "experiment" / "bare.yaml"
    bare.write_text(MINE.replace("# @package _global_\n", ""))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        compose(["experiment=bare"])
    assert err.value.key == "experiment" and str(bare.resolve()) in err.value.problem
    assert err.value.fix == f"make `# @package _global_` the first line of {bare.resolve()}"
    bare.write_text("# @package _global_\n" + bare.read_text())  # the fix, applied
    assert compose(["experiment=bare"]).train.max_steps == 2

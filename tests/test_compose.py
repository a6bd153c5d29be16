"""Every option of every config group composes; numeric group choices work as typed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import compose_cfg, run_cli
from zerotune import CONF_DIR
from zerotune.cli.overrides import group_options, normalize_overrides, with_search_path
from zerotune.errors import ConfigError

GROUPS = group_options(CONF_DIR)
ALL_OPTIONS = [(g, o) for g, opts in GROUPS.items() if g != "experiment" for o in opts]


def test_expected_groups_exist():
    for group in ("zero_stage", "offload", "optimizer", "scheduler", "resolution", "model", "data",
                  "precision", "logger"):
        assert GROUPS.get(group), f"config group {group} is missing"
    assert GROUPS["zero_stage"] == ["0", "1", "2", "3"]
    assert set(GROUPS["offload"]) == {"none", "cpu", "nvme"}
    assert {"128", "256", "512", "768", "1024"} <= set(GROUPS["resolution"])


@pytest.mark.parametrize(("group", "option"), ALL_OPTIONS)
def test_every_option_composes(group, option):
    extra = ["offload.path=/tmp"] if (group, option) == ("offload", "nvme") else []
    cfg = compose_cfg(f"{group}={option}", *extra)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    node = cfg[group]
    if group == "zero_stage":
        assert node.stage == int(option)
    elif group == "resolution":
        assert node.size == int(option)
    else:
        assert node.get("name", node.get("device")) == option


def test_unquoted_numeric_choices_are_quoted():
    assert normalize_overrides(["zero_stage=2", "offload=cpu"], CONF_DIR) == ["zero_stage='2'", "offload='cpu'"]
    assert normalize_overrides(["zero_stage=1,2,3"], CONF_DIR) == ["zero_stage='1','2','3'"]
    assert normalize_overrides(["resolution=128,1024", "train.batch_size=1,8"], CONF_DIR) == [
        "resolution='128','1024'", "train.batch_size=1,8"]


def test_optimizer_choice_is_case_insensitive(caplog):
    assert normalize_overrides(["optimizer=AdamW"], CONF_DIR) == ["optimizer='adamw'"]
    assert normalize_overrides(["optimizer=CPUAdam"], CONF_DIR) == ["optimizer='adamw'"]
    assert "AdamW implementation" in caplog.text


def test_unknown_group_choice_names_options():
    with pytest.raises(ConfigError) as err:
        normalize_overrides(["zero_stage=5"], CONF_DIR)
    assert err.value.key == "zero_stage" and "0, 1, 2, 3" in err.value.fix
    with pytest.raises(ConfigError) as err:
        normalize_overrides(["resolution=96"], CONF_DIR)
    assert "resolution.size=96" in err.value.fix


def test_hydra_functions_and_quoted_values_pass_through():
    args = ["zero_stage=choice('1','2')", "zero_stage='3'", "+foo=1", "--cfg", "job"]
    assert normalize_overrides(args, CONF_DIR) == args


@pytest.mark.parametrize("args", [["zero_stage=3", "offload=cpu", "--cfg", "job"], ["--cfg", "job", "zero_stage=3", "offload=cpu"]])
def test_cfg_job_prints_composed_config_with_the_overrides_before_or_after_it(args):
    proc = run_cli(*args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.zero_stage.stage == 3 and printed.offload.device == "cpu"


def test_the_experiments_search_path_joins_the_overrides_not_a_flag():
    path = f"hydra.searchpath=[file://{CONF_DIR.parent / 'experiments'}]"
    assert with_search_path(["a=1", "--cfg", "job"], CONF_DIR) == ["a=1", path, "--cfg", "job"]
    assert with_search_path(["-m", "a=1,2"], CONF_DIR) == ["-m", "a=1,2", path]
    assert with_search_path(["--cfg", "job"], CONF_DIR) == ["--cfg", "job", path]
    assert with_search_path(["a=1", "hydra.searchpath=[x]"], CONF_DIR) == ["a=1", "hydra.searchpath=[x]"]


def test_cfg_job_prints_composed_config():
    proc = run_cli("--cfg", "job", "zero_stage=3", "offload=cpu", timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.zero_stage.stage == 3 and printed.offload.device == "cpu"
    assert printed.model.name == "tiny" and printed.data.name == "digits"

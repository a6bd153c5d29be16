"""Every option of every config group composes; numeric group choices work as typed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import compose_cfg, run_cli
from zerotune.config.compose.overrides import normalize_overrides, take_config_dir
from zerotune.config.errors import ConfigError
from zerotune.config.search import ConfigSearch

PACKAGED = ConfigSearch()  # the packaged configs alone
GROUPS = PACKAGED.group_options()
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
    assert normalize_overrides(["zero_stage=2", "offload=cpu"], PACKAGED) == ["zero_stage='2'", "offload='cpu'"]
    assert normalize_overrides(["zero_stage=1,2,3"], PACKAGED) == ["zero_stage='1','2','3'"]
    assert normalize_overrides(["resolution=128,1024", "train.batch_size=1,8"], PACKAGED) == [
        "resolution='128','1024'", "train.batch_size=1,8"]


def test_optimizer_choice_is_case_insensitive(caplog):
    assert normalize_overrides(["optimizer=AdamW"], PACKAGED) == ["optimizer='adamw'"]
    assert normalize_overrides(["optimizer=CPUAdam"], PACKAGED) == ["optimizer='adamw'"]
    assert "AdamW implementation" in caplog.text


def test_unknown_group_choice_names_options():
    with pytest.raises(ConfigError) as err:
        normalize_overrides(["zero_stage=5"], PACKAGED)
    assert err.value.key == "zero_stage" and "0, 1, 2, 3" in err.value.fix
    with pytest.raises(ConfigError) as err:
        normalize_overrides(["resolution=96"], PACKAGED)
    assert "resolution.size=96" in err.value.fix


def test_hydra_functions_and_quoted_values_pass_through():
    args = ["zero_stage=choice('1','2')", "zero_stage='3'", "+foo=1", "--cfg", "job"]
    assert normalize_overrides(args, PACKAGED) == args


@pytest.mark.parametrize("args", [["zero_stage=3", "offload=cpu", "--cfg", "job"], ["--cfg", "job", "zero_stage=3", "offload=cpu"]])
def test_cfg_job_prints_composed_config_with_the_overrides_before_or_after_it(args):
    proc = run_cli(*args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.zero_stage.stage == 3 and printed.offload.device == "cpu"


def test_config_dir_is_taken_off_the_command_line_in_each_of_hydras_spellings():
    assert take_config_dir(["a=1", "--config-dir", "mine", "--cfg", "job"]) == (["a=1", "--cfg", "job"], "mine")
    assert take_config_dir(["-cd", "mine", "-m", "a=1,2"]) == (["-m", "a=1,2"], "mine")
    assert take_config_dir(["--config-dir=mine", "a=1"]) == (["a=1"], "mine")
    assert take_config_dir(["a=1"]) == (["a=1"], None)
    with pytest.raises(ConfigError) as exc:
        take_config_dir(["a=1", "--config-dir"])
    assert exc.value.key == "--config-dir"


def test_cfg_job_prints_composed_config():
    proc = run_cli("--cfg", "job", "zero_stage=3", "offload=cpu", timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    assert printed.zero_stage.stage == 3 and printed.offload.device == "cpu"
    assert printed.model.name == "tiny" and printed.data.name == "digits"

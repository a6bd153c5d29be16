"""The helper that applies a config error's fix line (tests/helpers/fixes.py), itself checked: it reads the
fix lines zerotune writes, and it fails when a fix does not work. Every `plan_error` in test_validation.py
and test_bad_input.py applies the fix of the error it expects through it."""

from __future__ import annotations

import pytest

from tests.helpers.cli import compose_cfg, preflight
from tests.helpers.fixes import alternatives, applied, check_fix
from zerotune.config.errors import ConfigError


@pytest.mark.parametrize(("fix", "expected"), [
    ("zero_stage=3, or offload.params=false", [["zero_stage=3"], ["offload.params=false"]]),
    ("zero_stage=2 offload=cpu, or offload=none", [["zero_stage=2", "offload=cpu"], ["offload=none"]]),
    ("train.batch_size=<int>, e.g. train.batch_size=64", [["train.batch_size=64"]]),
    ("zero_stage.stage=<0, 1, 2 or 3>, e.g. zero_stage.stage=3", [["zero_stage.stage=3"]]),
    ("zerotune plan ... --all for options that fit, or plan.guard=warn to run anyway",
     [["plan.guard=warn"]]),
    ("precision=fp32, or plan it for a card that can: zerotune plan precision=bf16 --gpu NAME",
     [["precision=fp32"]]),
    ("model.unet.block_out_channels=[32,64] model.unet.layers_per_block=1",
     [["model.unet.block_out_channels=[32,64]", "model.unet.layers_per_block=1"]]),
    ('set "fp16": {"enabled": false} in ds.json', []),
    ("offload.path=/path/to/nvme/folder", []),
    ("`wandb login`, or logger.mode=offline", [["logger.mode=offline"]]),
])
def test_fix_lines_are_read_as_their_alternatives(fix, expected):
    assert alternatives(fix) == expected


def test_a_fix_replaces_what_was_typed_for_its_keys_and_the_bad_value_its_group_replaces():
    typed = ["zero_stage=2", "offload=nvme", "offload.path=/swap", "resolution.size=0"]
    assert applied(typed, ["zero_stage=3"]) == ["offload=nvme", "offload.path=/swap", "resolution.size=0",
                                                "zero_stage=3"]
    assert applied(typed, ["resolution=1024"], "resolution.size") == ["zero_stage=2", "offload=nvme",
                                                                      "offload.path=/swap", "resolution=1024"]


def passes(overrides: list[str]) -> None:
    preflight(compose_cfg(*overrides), overrides=overrides)


def test_a_fix_that_does_not_work_fails_the_check():
    typed = ["zero_stage=2", "offload=cpu", "offload.params=true"]
    with pytest.raises(ConfigError) as err:
        passes(typed)
    assert check_fix(err.value, typed, passes) == 2  # zero_stage=3, or offload.params=false: both work
    broken = ConfigError(err.value.key, err.value.problem, "zero_stage=1, or offload.params=false")
    with pytest.raises(AssertionError, match="the fix `zero_stage=1` for `zero_optimization.offload_param` does not work"):
        check_fix(broken, typed, passes)

"""deepspeed.param_groups: the trained parameters cut into K contiguous optimizer groups, so that ZeRO-1/2 load one
group at a time. The cut's rule, how `auto` resolves, the update unchanged by K, and a resume across K."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import compose_cfg, read_losses, run_cli
from zerotune.config.errors import ConfigError
from zerotune.models.param_groups import AUTO_ZERO12, ParamGroups, count, layout

# ----------------------------------------------------------------------------------------------- the cut


def test_the_cut_is_contiguous_follows_equal_shares_and_starts_anew_at_each_module():
    # 10 + 10 + 10 + 10 elements in one module, K=2: shares of 20 elements; parameters start at 0, 10, 20, 30
    assert layout([[10, 10, 10, 10]], 2) == ((2, 2),)
    assert layout([[10, 10, 10, 10]], 1) == ((4,),)
    # a large parameter spans shares: it stays whole, in the share where it starts
    assert layout([[35, 1, 1, 1, 1, 1]], 4) == ((1, 5),)
    # two modules (the U-Net, a trained text encoder): never a group across them
    assert layout([[10, 10], [10, 10]], 1) == ((2,), (2,))
    assert layout([[10, 10], [10, 10]], 2) == ((2,), (2,))
    assert layout([[10, 10], [10, 10]], 4) == ((1, 1), (1, 1))


@pytest.mark.parametrize("groups", [1, 2, 3, 16, 64])
def test_every_parameter_is_in_exactly_one_group_and_none_is_empty(groups):
    unet = [(i * 7919) % 1000 + 1 for i in range(300)]
    encoder = [(i * 104729) % 500 + 1 for i in range(40)]
    cut = layout([unet, encoder], groups)
    assert [sum(m) for m in cut] == [len(unet), len(encoder)]
    assert all(n >= 1 for m in cut for n in m)
    assert sum(len(m) for m in cut) <= groups + 1  # at most K + (modules - 1)
    sizes = ParamGroups.cut([unet, encoder], groups).sizes()
    assert sizes == [n for m in cut for n in m]


def test_the_groups_hold_about_equal_shares_of_the_weights():
    """SDXL's U-Net parameters: each of 16 groups holds close to 1/16 of the elements (what bounds the loading
    peak), the largest parameter (13.1M of 2.57G) being the granularity."""
    from zerotune.models import model_stats

    cfg = compose_cfg("model=sdxl")
    stats = model_stats(cfg.model)
    numels = stats.module_numels()
    cut = layout(numels, AUTO_ZERO12)
    assert len(cut[0]) == AUTO_ZERO12
    start, total = 0, sum(numels[0])
    for n in cut[0]:
        share = sum(numels[0][start:start + n]) / total
        start += n
        assert share == pytest.approx(1 / AUTO_ZERO12, abs=stats.largest_param_numel / total)


def test_auto_is_sixteen_at_zero_1_and_2_one_elsewhere_and_a_checkpoints_own_on_resume():
    assert [count("auto", stage) for stage in (0, 1, 2, 3)] == [1, AUTO_ZERO12, AUTO_ZERO12, 1]
    assert count(4, 3) == 4 and count(1, 2) == 1
    # a ZeRO-1/2 checkpoint: its own count, 1 where it predates the setting
    assert count("auto", 2, {"use_deepspeed": True, "zero_stage": 2, "param_groups": 4}) == 4
    assert count("auto", 2, {"use_deepspeed": True, "zero_stage": 1}) == 1
    # a ZeRO-3 or stage-0 checkpoint holds its state by parameter: the stage's own default
    assert count("auto", 2, {"use_deepspeed": True, "zero_stage": 3}) == AUTO_ZERO12


@pytest.mark.parametrize("value", [0, -2, "many", 1.5, True])
def test_a_bad_count_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError) as refused:
        count(value, 2)
    assert refused.value.key == "deepspeed.param_groups" and "deepspeed.param_groups=auto" in refused.value.fix


def test_a_bad_count_on_the_command_line_exits_2_naming_the_key(tmp_path):
    proc = run_cli("deepspeed.param_groups=0", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "deepspeed.param_groups" in proc.stderr and "deepspeed.param_groups=auto" in proc.stderr


# --------------------------------------------------------------------------------- the update, any K

STEPS = 20
# fp32 on the CPU: each group's partition is updated element by element as one group's would be; the clipping
# norm adds the groups' squared norms in another order (a few ulps). 1e-6 relative over 20 steps.
RTOL = 1e-6


def _losses(run, *overrides: str) -> list[float]:
    proc = run_cli("zero_stage=2", f"train.max_steps={STEPS}", "train.batch_size=8", "train.log_every=1",
                   "evaluate.enabled=false", "checkpoint.final=false", *overrides, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_losses(run)


CASES = {"offload_none": ("offload=none",), "offload_cpu": ("offload=cpu",),
         "offload_none_2proc": ("offload=none", "launch.num_processes=2"),
         "offload_cpu_2proc": ("offload=cpu", "launch.num_processes=2")}


@pytest.mark.parametrize("case", [c if "2proc" not in c else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_the_losses_are_the_same_for_one_group_and_for_auto(case, tmp_path, request):
    if "offload_cpu" in case:
        request.getfixturevalue("built_offload_ops")
    one = _losses(tmp_path / "one", "deepspeed.param_groups=1", *CASES[case])
    auto = _losses(tmp_path / "auto", *CASES[case])
    resolved = json.loads((tmp_path / "auto" / "resolved.json").read_text())["param_groups"]
    assert resolved["count"] == AUTO_ZERO12 and len(resolved["layout"][0]) > 1
    assert len(one) == STEPS and len({round(x, 4) for x in one}) > 1  # it trained
    for step, (a, b) in enumerate(zip(one, auto, strict=True), start=1):
        assert b == pytest.approx(a, rel=RTOL), f"step {step}: {b} with {resolved['count']} groups, {a} with one"


# ------------------------------------------------------------------------------------------ a resume


def test_a_checkpoint_resumes_with_its_own_groups_and_another_count_is_refused_with_a_fix(tmp_path):
    first = tmp_path / "first"
    proc = run_cli("zero_stage=2", "train.max_steps=2", "train.batch_size=8", "evaluate.enabled=false",
                   f"hydra.run.dir={first}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = next((first / "checkpoints").glob("step-*"))
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["param_groups"] == AUTO_ZERO12 and len(meta["param_group_layout"][0]) > 1

    refused = run_cli("zero_stage=2", "train.max_steps=4", "train.batch_size=8", "evaluate.enabled=false",
                      "deepspeed.param_groups=4", f"resume={checkpoint}", f"hydra.run.dir={tmp_path / 'refused'}")
    assert refused.returncode == 2
    assert "deepspeed.param_groups" in refused.stderr and f"deepspeed.param_groups={AUTO_ZERO12}" in refused.stderr
    assert checkpoint.is_dir()  # nothing written is lost

    # the fix, applied: the checkpoint's own count
    again = tmp_path / "again"
    fixed = run_cli("zero_stage=2", "train.max_steps=4", "train.batch_size=8", "evaluate.enabled=false",
                    f"deepspeed.param_groups={AUTO_ZERO12}", f"resume={checkpoint}", f"hydra.run.dir={again}")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert json.loads((again / "summary.json").read_text())["steps"] == 4


def test_auto_resumes_a_checkpoint_from_before_the_groups_with_one(tmp_path):
    """A ZeRO-2 checkpoint whose meta.json predates deepspeed.param_groups held one group: auto keeps it."""
    from tests.helpers.cli import preflight
    from zerotune.rundir import checkpoints
    from zerotune.rundir.checkpoints import COMPLETE

    first = tmp_path / "first"
    proc = run_cli("zero_stage=2", "train.max_steps=2", "train.batch_size=8", "evaluate.enabled=false",
                   "deepspeed.param_groups=1", f"hydra.run.dir={first}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = next((first / "checkpoints").glob("step-*"))
    meta_file = checkpoint / "meta.json"
    meta = json.loads(meta_file.read_text())
    for key in ("param_groups", "param_group_layout"):
        meta.pop(key)
    meta_file.write_text(json.dumps(meta))
    # as that version saved it: its manifest (COMPLETE) lists the meta.json it wrote
    (checkpoint / COMPLETE).write_text(checkpoints.dumps(checkpoints.build(checkpoint, 2)))
    run = preflight(compose_cfg("zero_stage=2", f"resume={checkpoint}"), world_size=1, run_dir=tmp_path / "next")
    assert run.param_groups is not None and run.param_groups.count == 1 and run.resume is not None

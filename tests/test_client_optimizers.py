"""Client optimizers (optimizer=adafactor, adamw8bit, torch_adamw, sgd): zerotune builds them and hands them to
the engine. Their state rules against the real classes, the refusals with fixes that work when applied, the
resume rules, the tune knob; end to end: Adafactor at ZeRO-2 with offload=cpu, planned model states equal to
the engine's (the whole stage x offload x world grid per optimizer under `-m slow`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import benchmarks.bench_plan_model_states as bench
from tests.helpers.cli import compose_cfg, preflight
from zerotune.config import deepspeed_blocks as optimizers
from zerotune.config.errors import ConfigError
from zerotune.plan.model_states import Partitioning
from zerotune.plan.rules import Precision, client_kind, optimizer_state
from zerotune.plan.zero12 import zero12_flat
from zerotune.rundir.resume import conversion_mode, current_meta, decide_resume
from zerotune.train.engine import _state_bytes, client_optimizer
from zerotune.tune.space import read_command_line

# a linear weight, a 3x3 conv kernel, a bias, one tensor past bitsandbytes' 8-bit threshold and one below it
SHAPES = [(4, 6), (3, 3, 2, 2), (5,), (80, 70), (20, 30)]
FP32 = Precision("fp32", 4, 4, 4, False)
CLIENTS = ["adafactor", "adamw8bit", "torch_adamw", "sgd"]


def spec(name: str, *overrides: str) -> dict:
    checked = preflight(compose_cfg(f"optimizer={name}", *overrides))
    assert checked.client_optimizer is not None and "optimizer" not in checked.ds_config
    return checked.client_optimizer


@pytest.mark.parametrize("name", CLIENTS)
def test_state_rule_equals_the_real_class_after_a_step(name):
    """The planner's bytes for these shapes against the class's own state after one step (each storage once:
    bitsandbytes' quantisation maps are shared)."""
    client = spec(name)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = client_optimizer(client, params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert optimizer_state(client_kind(client, FP32), SHAPES) == _state_bytes(opt)


def test_adafactor_factors_whole_tensors_but_not_zero_partitions():
    client = spec("adafactor")
    numels = [math.prod(s) for s in SHAPES]
    plain = Partitioning(numels, {}, 1, False, client_optimizer=client, trainable_shapes=SHAPES).states["optimizer_state_bytes"]
    rows_cols = 4 + 6 + 18 + 18 + 5 + 80 + 70 + 20 + 30  # 1-D: the whole second moment (5)
    assert plain == rows_cols * 4 + 4 * len(SHAPES)  # + a 0-d fp32 RMS each
    ds = {"zero_optimization": {"stage": 2}}
    flat = zero12_flat(numels, 1, False, 4)
    # ZeRO-2 hands it one flat 1-D partition: a whole second moment, smaller saving than the paper's
    zero2 = Partitioning(numels, ds, 1, client_optimizer=client, trainable_shapes=SHAPES)
    assert zero2.states["optimizer_state_bytes"] == flat * 4 + 4
    with_momentum = spec("adafactor", "optimizer.beta1=0.9")
    assert Partitioning(numels, ds, 1, client_optimizer=with_momentum).states["optimizer_state_bytes"] == flat * 8 + 4


def test_8bit_states_are_a_byte_per_element_plus_block_scales():
    kind = client_kind(spec("adamw8bit"), FP32)
    n = 1_000_000
    assert optimizer_state(kind, [(n,)]) == 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4
    assert optimizer_state(kind, [(100,)]) == 2 * 100 * 4  # under 4096 elements: fp32 states, no maps


def test_the_plan_names_the_optimizer_and_its_source():
    checked = preflight(compose_cfg("optimizer=adafactor", "zero_stage=2", "offload=cpu"))
    from zerotune.plan import predict

    plan = predict.predict(checked, None, device="cpu")
    terms = [t for t in plan.host_terms if t.term == "optimizer_states"]
    assert terms and "transformers.Adafactor" in terms[0].note and "optimization.py" in terms[0].note


# ------------------------------------------------------------------------------------------- refusals


def _refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*overrides), overrides=overrides)  # as train.py: the typed overrides known
    return err.value


def test_8bit_without_usable_kernels_is_refused_and_the_fix_works(monkeypatch):
    monkeypatch.setattr(optimizers, "_bnb_runs_on_cpu", lambda: False)
    err = _refused("optimizer=adamw8bit", "zero_stage=2", "offload=cpu")
    assert err.key == "optimizer.name" and "bitsandbytes" in err.problem
    assert "optimizer=adafactor" in err.fix
    assert preflight(compose_cfg("optimizer=adafactor", "zero_stage=2", "offload=cpu")).client_optimizer


def test_a_key_the_class_does_not_take_is_named_and_the_fix_works():
    err = _refused("optimizer=adafactor", "optimizer.betas=[0.9,0.99]")
    assert err.key == "optimizer.betas" and "remove optimizer.betas" in err.fix
    assert preflight(compose_cfg("optimizer=adafactor")).client_optimizer["params"]["relative_step"] is False


def test_a_deepspeed_files_optimizer_block_conflicts_and_the_fix_works(tmp_path):
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                "zero_optimization": {"stage": 2}}))
    typed = (f"deepspeed.config_file={file}", "optimizer=adafactor")
    err = _refused(*typed)  # the file's AdamW against the typed choice
    assert err.key.startswith("optimizer") and "optimizer=adafactor" in err.problem
    # a block without a type leaves optimizer=adafactor chosen: the builder refuses to drop either
    file.write_text(json.dumps({"optimizer": {"params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}))
    err = _refused(*typed)
    assert err.key == "optimizer" and "remove the optimizer block" in err.fix
    file.write_text(json.dumps({"zero_optimization": {"stage": 2}}))  # the fix, applied
    checked = preflight(compose_cfg(*typed), overrides=typed)
    assert checked.client_optimizer["name"] == "adafactor" and checked.ds_config["zero_force_ds_cpu_optimizer"] is False


def _meta(*overrides: str) -> dict:
    checked = preflight(compose_cfg(*overrides))
    return current_meta(checked.config, checked.ds_config, checked.use_deepspeed, 1, checked.client_optimizer)


def test_resume_refuses_another_optimizers_state(tmp_path):
    saved = _meta("optimizer=adafactor")
    (tmp_path / "meta.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError) as err:
        decide_resume(tmp_path, _meta("optimizer=adamw"), {})
    assert err.value.key == "optimizer" and "optimizer=adafactor" in err.value.fix
    assert decide_resume(tmp_path, _meta("optimizer=adafactor"), {}).mode == "native"


def test_a_client_optimizers_state_is_not_converted_across_stages(tmp_path):
    saved, now = _meta("optimizer=adafactor", "zero_stage=2"), _meta("optimizer=adafactor", "zero_stage=3")
    with pytest.raises(ConfigError, match="adafactor's state has no conversion") as err:
        conversion_mode(Path(tmp_path), saved, now)
    assert "zerotune export" in err.value.fix


def test_tune_takes_the_optimizer_as_a_knob():
    line = read_command_line(["optimizer=adamw,adafactor", "zero_stage=2"])
    assert line.values["optimizer"] == ["adamw", "adafactor"] and "optimizer" not in line.workload


# ------------------------------------------------------------------------------------------- vs the engine


def _engine_check(monkeypatch, tmp_path, optimizer: str, combos: list[tuple]) -> None:
    monkeypatch.setattr(bench, "EXTRA", [f"optimizer={optimizer}"])
    engine = bench.engine_partitions(combos, tmp_path, bench.ROOT)
    bad = [r for c in combos if not bench.refused(*c) for r in bench.compare(c, engine[c]) if r["diff"]]
    assert not bad, bad


def test_adafactor_at_zero2_with_cpu_offload_matches_the_plan(monkeypatch, tmp_path):
    _engine_check(monkeypatch, tmp_path, "adafactor", [("sdxl_tiny", 2, "cpu", 1)])


@pytest.mark.slow  # four sweeps of 14 engines each
@pytest.mark.parametrize("name", CLIENTS)
def test_every_client_optimizer_matches_the_plan_on_the_grid(name, monkeypatch, tmp_path):
    grid = [(m, s, o, w) for m in ("sdxl_tiny",) for s in range(4) for o in ("none", "cpu") for w in (1, 2)]
    _engine_check(monkeypatch, tmp_path, name, grid)


def test_adafactors_step_copies_are_planned_where_it_steps():
    """Two fp32 copies of the tensor it steps (one parameter group's flat partition here: ZeRO-2 steps the groups
    one at a time): on the device, or on the host when offloaded; and an offloaded client optimizer's step time
    is unmeasured, not CPU-Adam's."""
    from zerotune.plan import predict
    from zerotune.plan.gpus import lookup

    for offload, where in (("none", "gpu_terms"), ("cpu", "host_terms")):
        checked = preflight(compose_cfg("optimizer=adafactor", "zero_stage=2", f"offload={offload}"))
        plan = predict.predict(checked, lookup("rtx4090"))
        temps = [t for t in getattr(plan, where) if t.term == "optimizer_temporaries"]
        stats = checked.model_stats
        states = Partitioning(list(stats.param_numels), checked.ds_config, 1, groups=checked.group_sizes(),
                              client_optimizer=checked.client_optimizer).states
        assert len(states["step_groups"]) > 1  # deepspeed.param_groups: auto (16) at ZeRO-2, as the layout cuts them
        assert temps and temps[0].mib * 2**20 == pytest.approx(2 * max(states["step_groups"]) * 4), where
    times = {t.term: t for t in plan.time_terms}
    assert times["cpu_optimizer"].seconds is None and "unmeasured" in times["cpu_optimizer"].note


def test_8bit_states_through_nvme_are_refused_and_the_fix_works(tmp_path):
    err = _refused("optimizer=adamw8bit", "zero_stage=3", "offload=nvme", f"offload.path={tmp_path}")
    assert err.key == "optimizer.name" and "offload=cpu" in err.fix
    assert preflight(compose_cfg("optimizer=adamw8bit", "zero_stage=3", "offload=cpu")).client_optimizer


def test_a_file_forcing_cpu_adam_is_refused_and_the_fix_works(tmp_path):
    """accelerate would swap an offloaded client optimizer for CPU Adam: another optimizer than the one planned."""
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_force_ds_cpu_optimizer": True, "zero_optimization": {"stage": 2}}))
    typed = (f"deepspeed.config_file={file}", "optimizer=adafactor", "offload=cpu")
    err = _refused(*typed)
    assert err.key.endswith("zero_force_ds_cpu_optimizer") and "remove zero_force_ds_cpu_optimizer" in err.fix
    file.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert preflight(compose_cfg(*typed), overrides=typed).ds_config["zero_force_ds_cpu_optimizer"] is False


def test_adafactors_step_copies_are_what_torch_allocates():
    """The planner's two fp32 copies against one real Adafactor step on a flat 1-D tensor (ZeRO's partition),
    measured by torch.profiler (activations.py's allocation record)."""
    from torch.profiler import ProfilerActivity, profile

    from zerotune.plan.activations import _peaks

    n = 1_000_000
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = client_optimizer(spec("adafactor"), [param])
    opt.step()  # the state, allocated once
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    assert _peaks(prof.profiler.kineto_results.events()).between_ops == pytest.approx(2 * n * 4, rel=1e-3)

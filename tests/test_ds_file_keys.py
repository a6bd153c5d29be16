"""The top-level keys of a user's DeepSpeed JSON: every key DeepSpeed reads has a decision (honoured, translated
or refused, config/deepspeed_file.py), keys DeepSpeed ignores pass with a warning unless they ask for something,
a misspelt key is an error naming the nearest known one, and every fix an error of a user's file gives works
when applied: the run is then accepted."""

from __future__ import annotations

import json
import logging
import re
import shlex

import pytest

from tests.helpers.cli import ROOT, compose_cfg, preflight, read_summary, run_cli
from zerotune.config import deepspeed_file
from zerotune.config import deepspeed_file as ds_keys
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.host.platform import ANY_CUDA_GPU, Platform

CORPUS = ROOT / "tests" / "data" / "ds_configs"
SECRET = "ZEROTUNEFAKEKEY"  # inside the fake private_key of gcp_service_account.json
NO_FP16 = Platform("cpu", True, "", bf16=True, fp16=False)
NO_DEEPSPEED = Platform("mps", False, "DeepSpeed does not support macOS/MPS", bf16=False, fp16=True)
BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}

# Keys of the table that DeepSpeed's config parser does not read: LLaMA-Factory's "fp8" (DeepSpeed has no such
# key), an older spelling, one it reads only once torch.distributed is up, and what only the environment gives.
# The "ignored" keys are not read either (test_every_key_deepspeed_reads_has_a_decision).
NOT_READ_BY_DEEPSPEED_CONFIG = {"fp8", "fp32_allreduce", "sequence_parallel_size", "cuda_visible_devices",
                                "CUDA_VISIBLE_DEVICES"}

# For each refused key: a value asking for what is refused, and one asking for nothing.
REFUSED_VALUES = {
    "fp8": ({"enabled": True}, {"enabled": False}),
    "torch_autocast": ({"enabled": True, "dtype": "bfloat16"}, {"enabled": False}),
    "activation_checkpointing": ({"partition_activations": True}, {"partition_activations": False}),
    "flops_profiler": ({"enabled": True, "profile_step": 1}, {"enabled": False}),
    "comms_logger": ({"enabled": True, "verbose": False}, {"enabled": False}),
    "tensorboard": ({"enabled": True, "output_path": "tb"}, {"enabled": False}),
    "wandb": ({"enabled": True, "project": "p"}, {"enabled": False}),
    "comet": ({"enabled": True}, {"enabled": False}),
    "autotuning": ({"enabled": True}, {"enabled": False}),
    "data_efficiency": ({"enabled": True}, {"enabled": False}),
    "pipeline": ({"stages": 2}, {}),
    "hybrid_engine": ({"enabled": True}, {"enabled": False}),
    "tensor_parallel": ({"autotp_size": 2}, {"autotp_size": 0}),
    "sequence_parallel_size": (2, 1),
    "expert_parallel": ({"enabled": True, "autoep_size": 2}, {"enabled": False}),
    "use_data_before_expert_parallelism": (True, False),
    "weight_quantization": ({"quantized_initialization": {"num_bits": 8}}, {}),
    "compile": ({"deepcompile": True}, {"deepcompile": False}),
    "checkpoint": ({"load_universal": True}, {"tag_validation": "Fail"}),
    "datastates_ckpt": ({"host_cache_size": 16}, False),
    "dataloader_drop_last": (False, True),
    "managed_gradient_accumulation": (False, True),
    "disable_allgather": (True, False),
    "cuda_visible_devices": ("0,1", ""),
    "CUDA_VISIBLE_DEVICES": (0, None),
    "amp": ({"enabled": True, "opt_level": "O1"}, {"enabled": False}),
    "sparse_attention": ({"mode": "fixed", "block": 16}, {}),
    "elasticity": ({"enabled": True, "max_train_batch_size": 64}, {"enabled": False}),
    "nebula": ({"enabled": True}, {"enabled": False}),
    "compression_training": ({"weight_quantization": {"shared_parameters": {"enabled": True}}},
                             {"weight_quantization": {"shared_parameters": {"enabled": False}}}),
    "quantize_training": ({"enabled": True}, {"enabled": False}),
    "eigenvalue": ({"enabled": True}, {"enabled": False}),
    "sparse_gradients": (True, False),
    "graph_harvesting": (True, False),
    "curriculum_learning": ({"enabled": True, "curriculum_type": "seqlen"}, {"enabled": False}),
    "progressive_layer_drop": ({"enabled": True, "theta": 0.5}, {"enabled": False}),
}

# For each key DeepSpeed ignores: LLaMA-Factory's value (asks for nothing), and one asking for what DeepSpeed
# would not do.
IGNORED_VALUES = {
    "comms_config": ({"verbose": False}, {"enabled": True, "verbose": True}),
    "monitor_config": ({"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
                       {"enabled": True, "csv_monitor": {"enabled": True, "output_path": "csv"}}),
}

# The fix of each refused key, applied to BASE + the key: what the file becomes, and the overrides it adds.
APPLIED_FIXES = {
    "fp8": ({"bf16": {"enabled": True}}, []),
    "torch_autocast": ({"bf16": {"enabled": True}}, []),
    "activation_checkpointing": ({}, ["train.gradient_checkpointing=true"]),
    "amp": ({"bf16": {"enabled": True}}, []),
    "checkpoint": ({"checkpoint": {"tag_validation": "Fail"}}, []),
    "tensor_parallel": ({"tensor_parallel": {"autotp_size": 0}}, []),
    "compile": ({"compile": {"deepcompile": False}}, []),
    "sequence_parallel_size": ({"sequence_parallel_size": 1}, []),
}


def write(tmp_path, data: dict, name: str = "ds.json") -> str:
    file = tmp_path / name
    file.write_text(json.dumps(data))
    return str(file)


def check(file: str, *overrides: str, platform: Platform | None = None):
    """preflight as `python train.py deepspeed.config_file=FILE OVERRIDES` runs it."""
    names = [f"deepspeed.config_file={file}", "accelerate.config_file=null", *overrides]
    return preflight(compose_cfg(*names), overrides=names, platform=platform)


def refused(file: str, *overrides: str, platform: Platform | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check(file, *overrides, platform=platform)
    return err.value


# ---------------------------------------------------------------- the table against DeepSpeed


def keys_deepspeed_reads() -> set[str]:
    """The top-level keys DeepSpeed's DeepSpeedConfig looks up, recorded as it parses a minimal config."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class Keys:
        def __init__(self, data):
            self.data = data

        def __contains__(self, key):
            seen.add(key)
            return dict.__contains__(self.data, key)

        def __iter__(self):
            return iter(dict.keys(self.data))

    class Recording(dict):
        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def keys(self):
            return Keys(self)

        def __copy__(self):
            return self

    DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    return seen


def test_every_key_deepspeed_reads_has_a_decision():
    read = keys_deepspeed_reads()
    assert len(read) > 40  # the recording saw the parser's look-ups
    assert read - set(ds_keys.KEYS) == set(), "a key DeepSpeed reads and the table does not decide"
    ignored = {name for name, d in ds_keys.KEYS.items() if d.kind == ds_keys.IGNORED}
    assert ignored == set(IGNORED_VALUES) and ignored.isdisjoint(read)
    assert set(ds_keys.KEYS) - read == NOT_READ_BY_DEEPSPEED_CONFIG | ignored


def test_the_features_deepspeed_removed_are_the_ones_marked_removed():
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    marked = {name for name, d in ds_keys.KEYS.items() if d.removed}
    assert marked == set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)


def test_every_decision_says_why_and_every_refusal_how():
    for name, decision in ds_keys.KEYS.items():
        assert decision.kind in (ds_keys.HONOURED, ds_keys.TRANSLATED, ds_keys.REFUSED, ds_keys.IGNORED), name
        assert decision.reason and "\n" not in decision.reason, name
        assert (decision.kind in (ds_keys.REFUSED, ds_keys.IGNORED)) == bool(decision.fix), name
    assert set(REFUSED_VALUES) == {n for n, d in ds_keys.KEYS.items() if d.kind == ds_keys.REFUSED}


def test_the_docs_list_every_key_with_its_decision():
    page = (ROOT / "docs" / "deepspeed-config.md").read_text()
    start = page.index("## DeepSpeed's top-level keys")
    section = page[start:page.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for name, decision in ds_keys.KEYS.items():
        assert any(row.startswith(f"| {decision.kind} |") and re.search(rf"`{name}[`:]", row) for row in rows), name


# ---------------------------------------------------------------- refused keys, and their fixes applied


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refused_key_that_asks_for_its_feature_is_an_error_naming_it(name, tmp_path):
    asks, _ = REFUSED_VALUES[name]
    with pytest.raises(ConfigError) as err:
        deepspeed_file.load(write(tmp_path, {**BASE, name: asks}))
    assert err.value.key == name and "(ds.json)" in err.value.problem
    assert err.value.fix == ds_keys.KEYS[name].fix


def test_values_that_ask_for_nothing_are_accepted_together(tmp_path, caplog):
    """`"enabled": false` and the like pass (DeepSpeed accepts them); a removed feature's is dropped."""
    data = {**BASE, **{name: off for name, (_, off) in REFUSED_VALUES.items()}}
    with caplog.at_level(logging.WARNING):
        ds = check(write(tmp_path, data)).ds_config
    removed = {name for name, d in ds_keys.KEYS.items() if d.removed}
    assert removed.isdisjoint(ds) and "curriculum_learning\", which asks for nothing" in caplog.text
    assert ds["flops_profiler"] == {"enabled": False} and ds["dataloader_drop_last"] is True
    # DeepSpeed would turn its comms logger on for any "comms_logger" block, "enabled": false included
    assert "comms_logger" not in ds and 'dropped "comms_logger"' in caplog.text


def test_deepspeed_turns_its_comms_logger_on_for_a_disabled_block():
    """Why a disabled "comms_logger" is dropped rather than passed on (deepspeed/comm/config.py)."""
    from deepspeed.comm.comm import comms_logger, configure
    from deepspeed.runtime.config import DeepSpeedConfig

    was = comms_logger.enabled
    try:
        configure(DeepSpeedConfig({**BASE, "gradient_accumulation_steps": 1, "comms_logger": {"enabled": False}}))
        assert comms_logger.enabled is True
    finally:
        comms_logger.enabled = was


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_the_fix_of_a_refused_key_works(name, tmp_path):
    asks, _ = REFUSED_VALUES[name]
    fix = ds_keys.KEYS[name].fix
    edit, overrides = APPLIED_FIXES.get(name, ({}, []))
    assert f'"{name}"' in fix
    for typed in overrides:
        assert typed.split("=")[0] in fix
    fixed = {**BASE, **edit}
    assert refused(write(tmp_path, {**BASE, name: asks}, "before.json")).key == name
    check(write(tmp_path, fixed, "after.json"), *overrides)


# ---------------------------------------------------------------- keys DeepSpeed ignores


def warned_keys(warnings: list[str]) -> list[str]:
    """The key each warning line names ('ds.json: "comms_config" is not ...')."""
    return [re.match(r'\S+: (?:dropped )?"?([\w.]+)', line).group(1) for line in warnings]


def test_keys_deepspeed_ignores_pass_with_one_warning_each_and_are_left_out(tmp_path, caplog):
    data = {**BASE, **{name: nothing for name, (nothing, _) in IGNORED_VALUES.items()}}
    with caplog.at_level(logging.WARNING):
        checked = check(write(tmp_path, data))
    assert warned_keys(checked.config_warnings) == ["comms_config", "monitor_config"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == list(checked.config_warnings)
    assert "DeepSpeed ignores it" in checked.config_warnings[0] and '"comms_logger"' in checked.config_warnings[0]
    assert '"csv_monitor"' in checked.config_warnings[1]
    assert set(IGNORED_VALUES).isdisjoint(checked.ds_config)


@pytest.mark.parametrize("name", sorted(IGNORED_VALUES))
def test_a_key_deepspeed_ignores_that_asks_for_something_is_refused_and_its_fix_works(name, tmp_path):
    _, asks = IGNORED_VALUES[name]
    err = refused(write(tmp_path, {**BASE, name: asks}, "before.json"))
    assert err.key == name and "ignores" in err.problem and err.fix.startswith(f'delete "{name}"')
    assert check(write(tmp_path, BASE, "after.json")).config_warnings == ()


def test_monitor_config_refused_for_a_csv_log_is_fixed_at_the_top_level(tmp_path):
    """The fix's other half: DeepSpeed's CSV monitor, where DeepSpeed reads it."""
    err = refused(write(tmp_path, {**BASE, "monitor_config": IGNORED_VALUES["monitor_config"][1]}))
    assert '"csv_monitor" at the top level' in err.fix
    ds = check(write(tmp_path, {**BASE, "csv_monitor": {"enabled": True, "output_path": "csv"}})).ds_config
    assert ds["csv_monitor"]["enabled"] is True


def test_an_unknown_key_whose_value_turns_nothing_on_passes_with_a_warning(tmp_path):
    checked = check(write(tmp_path, {**BASE, "my_notes": {"draft": False, "ids": []}, "legacy_flag": None}))
    assert warned_keys(checked.config_warnings) == ["my_notes", "legacy_flag"]
    assert "my_notes" not in checked.ds_config and "legacy_flag" not in checked.ds_config


@pytest.mark.parametrize("name", ["cuda_visible_devices", "CUDA_VISIBLE_DEVICES"])
def test_visible_devices_in_the_file_are_refused_and_set_in_the_environment(name, tmp_path, monkeypatch):
    """Refused, not ignored: the GPUs a process sees are fixed before any file is read, so the run would use
    others than the file names. Its fix, applied: the key out of the file, the variable in the environment."""
    err = refused(write(tmp_path, {**BASE, name: "0,1"}, "before.json"))
    assert err.key == name and "CUDA_VISIBLE_DEVICES=0,1 zerotune train" in err.fix
    assert refused(write(tmp_path, {**BASE, name: 0}, "zero.json")).key == name  # GPU 0 is a request too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert check(write(tmp_path, BASE, "after.json")).config_warnings == ()


# ---------------------------------------------------------------- unknown keys


def test_an_unknown_key_names_the_nearest_known_one_and_the_renamed_file_runs(tmp_path):
    data = {**BASE, "gradient_clip": 0.5}
    err = refused(write(tmp_path, data))
    assert (err.key, err.fix) == ("gradient_clip", 'rename "gradient_clip" to "gradient_clipping" in ds.json')
    # a misspelling is refused even where its value turns nothing on: the author meant the real key
    assert refused(write(tmp_path, {**data, "gradient_clip": 0}, "zero.json")).key == "gradient_clip"
    data["gradient_clipping"] = data.pop("gradient_clip")
    checked = check(write(tmp_path, data))
    assert checked.ds_config["gradient_clipping"] == 0.5
    assert checked.config_sources["values"]["gradient_clipping"] == "file ds.json"


def test_an_unknown_key_with_no_near_one_is_deleted_and_its_value_never_shown(tmp_path):
    data = {**BASE, "api_token": "tok-" + SECRET, "zzz": 1}
    err = refused(write(tmp_path, data))
    assert err.key == "api_token" and "also unknown: zzz" in err.problem
    assert err.fix.startswith('delete "api_token" from ds.json') and SECRET not in str(err)
    del data["api_token"], data["zzz"]
    check(write(tmp_path, data))


def test_an_unknown_key_inside_a_block_names_the_nearest_field_without_its_value(tmp_path):
    data = {**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 123456789}}
    err = refused(write(tmp_path, data))
    assert (err.key, err.fix) == ("zero_optimization.reduce_bucket_sise", "rename it to reduce_bucket_size")
    assert "123456789" not in str(err)
    data["zero_optimization"]["reduce_bucket_size"] = data["zero_optimization"].pop("reduce_bucket_sise")
    assert check(write(tmp_path, data)).ds_config["zero_optimization"]["reduce_bucket_size"] == 123456789


def test_a_json_with_no_deepspeed_key_is_not_a_deepspeed_config():
    err = refused(str(CORPUS / "gcp_service_account.json"))
    assert err.key == "deepspeed.config_file" and "is not a DeepSpeed config" in err.problem
    assert SECRET not in str(err) and "private_key" not in str(err)
    check(str(CORPUS / "llava_zero2.json"))  # the fix: point it at a DeepSpeed JSON


def test_a_secret_file_stays_out_of_stderr_and_the_summary(tmp_path):
    proc = run_cli(f"deepspeed.config_file={CORPUS / 'gcp_service_account.json'}", "accelerate.config_file=null",
                   f"hydra.run.dir={tmp_path}", timeout=180)
    assert proc.returncode == CONFIG_ERROR_EXIT and "`deepspeed.config_file`" in proc.stderr
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout
    assert SECRET not in (tmp_path / "summary.json").read_text()
    assert read_summary(tmp_path)["error"]["key"] == "deepspeed.config_file"


def test_the_builders_import_refuses_a_secret_file_without_echoing_it(tmp_path, monkeypatch):
    from zerotune.builder import preview
    from zerotune.builder import workspace as importing

    monkeypatch.setattr(importing, "imports_dir", lambda: tmp_path)
    with pytest.raises(ConfigError) as err:
        importing.import_text((CORPUS / "gcp_service_account.json").read_text())
    assert err.value.key == "deepspeed.config_file"
    assert SECRET not in json.dumps(preview.error_entry(err.value))


# ---------------------------------------------------------------- translated and dropped


def test_an_older_spelling_is_translated_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        ds = check(write(tmp_path, {**BASE, "fp32_allreduce": True, "bfloat16": {"enabled": True}})).ds_config
    assert ds["communication_data_type"] == "fp32" and ds["bf16"]["enabled"] is True
    assert "fp32_allreduce" not in ds and "fp32_allreduce: true is a deprecated DeepSpeed key" in caplog.text


# ---------------------------------------------------------------- fixes of values a file states


def plan_overrides(fix: str) -> list[str]:
    """The overrides of the `zerotune plan ... --gpu NAME` a fix offers."""
    command = re.search(r"zerotune plan (.*) --gpu NAME", fix)
    assert command, fix
    return shlex.split(command.group(1))


def test_an_fp16_file_on_a_machine_without_fp16_is_fixed_in_the_file_or_planned_for_a_card(tmp_path):
    data = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}}
    file = write(tmp_path, data)
    err = refused(file, platform=NO_FP16)
    assert err.key == "fp16.enabled" and "(ds.json)" in err.problem
    assert "precision=" not in err.fix.split("python -m")[0]  # no override the file's fp16 would refuse
    assert refused(file, "precision=bf16", platform=NO_FP16).key == "precision.name"  # what that would give
    assert 'set "bf16": {"enabled": true} and "fp16": {"enabled": false} in ds.json' in err.fix
    ds = check(write(tmp_path, {**data, "fp16": {"enabled": False}, "bf16": {"enabled": True}}),
               platform=NO_FP16).ds_config
    assert ds["bf16"]["enabled"] is True
    assert 'set "fp16": {"enabled": false} and "bf16": {"enabled": false} in ds.json' in err.fix
    assert not check(write(tmp_path, {**data, "fp16": {"enabled": False}}), platform=NO_FP16).ds_config.get(
        "bf16", {}).get("enabled")
    overrides = plan_overrides(err.fix)
    assert overrides == [f"deepspeed.config_file={file}", "accelerate.config_file=null"]
    from zerotune.plan import gpus
    from zerotune.plan.command_line import plan_one

    assert plan_one(overrides, gpus.lookup("h100")).gpu  # what `zerotune plan ... --gpu h100` runs


def test_a_zero_file_where_deepspeed_is_missing_is_fixed_in_the_file(tmp_path):
    file = write(tmp_path, BASE)
    err = refused(file, platform=NO_DEEPSPEED)
    assert err.key == "zero_optimization.stage"
    assert err.fix.startswith("set zero_optimization.stage to 0 in ds.json")
    assert refused(file, "zero_stage=0", platform=NO_DEEPSPEED).key == "zero_stage.stage"  # the old loop
    checked = check(write(tmp_path, {**BASE, "zero_optimization": {"stage": 0}}, "fixed.json"), platform=NO_DEEPSPEED)
    assert not checked.use_deepspeed
    assert check(file, platform=ANY_CUDA_GPU).ds_config["zero_optimization"]["stage"] == 2  # the plan's check


def fixes_of(fix: str) -> list[str]:
    return [part.strip() for part in fix.split(", or ")]


def test_parameter_offload_below_stage_3_is_fixed_either_way_in_the_file(tmp_path):
    data = {**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    err = refused(write(tmp_path, data))
    assert err.key == "zero_optimization.offload_param"
    assert fixes_of(err.fix) == ["set zero_optimization.stage to 3 in ds.json",
                                 "delete zero_optimization.offload_param in ds.json"]
    check(write(tmp_path, {**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    check(write(tmp_path, BASE))


def test_parameter_offload_from_the_file_at_the_default_stage_takes_a_typed_stage(tmp_path):
    file = write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "offload_param": {"device": "cpu"}}})
    err = refused(file)
    assert fixes_of(err.fix) == ["zero_stage=3", "delete zero_optimization.offload_param in ds.json"]
    assert check(file, "zero_stage=3").ds_config["zero_optimization"]["stage"] == 3


def test_nvme_offload_below_stage_3_is_fixed_either_way_in_the_file(tmp_path):
    swap = str(tmp_path / "swap")
    data = {**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}}
    err = refused(write(tmp_path, data))
    assert err.key == "offload"
    assert fixes_of(err.fix) == ["set zero_optimization.stage to 3 in ds.json",
                                 'set "device": "cpu" in zero_optimization\'s offload blocks in ds.json']
    data["zero_optimization"]["stage"] = 3
    check(write(tmp_path, data))
    data["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "nvme_path": swap}}
    check(write(tmp_path, data))


def test_nvme_offload_without_a_folder_is_fixed_in_the_file(tmp_path):
    data = {**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    err = refused(write(tmp_path, data))
    assert err.fix == 'set "nvme_path" to /path/to/nvme/folder in zero_optimization\'s offload blocks in ds.json'
    data["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "swap")
    check(write(tmp_path, data))


def test_optimizer_offload_at_stage_0_is_fixed_either_way_in_the_file(tmp_path):
    data = {**BASE, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    err = refused(write(tmp_path, data))
    assert fixes_of(err.fix) == ["set zero_optimization.stage to 2 in ds.json", "delete zero_optimization."
                                 "offload_optimizer and zero_optimization.offload_param in ds.json"]
    check(write(tmp_path, {**data, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    check(write(tmp_path, {**data, "zero_optimization": {"stage": 0}}))


def test_an_offloaded_lamb_in_the_file_is_fixed_in_the_file(tmp_path):
    data = {**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    err = refused(write(tmp_path, data), platform=ANY_CUDA_GPU)
    assert fixes_of(err.fix) == ["delete zero_optimization.offload_optimizer and zero_optimization.offload_param "
                                 "in ds.json", 'set optimizer.type to "AdamW" in ds.json']
    check(write(tmp_path, {**data, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    check(write(tmp_path, {**data, "zero_optimization": {"stage": 2}}), platform=ANY_CUDA_GPU)


def test_a_negative_clip_or_a_stage_out_of_range_in_the_file_is_fixed_there(tmp_path):
    err = refused(write(tmp_path, {**BASE, "gradient_clipping": -1}))
    assert (err.key, err.fix) == ("gradient_clipping", "change gradient_clipping in ds.json")
    assert ">= 0 (0 disables clipping)" in err.problem
    assert check(write(tmp_path, {**BASE, "gradient_clipping": 1.0})).ds_config["gradient_clipping"] == 1.0
    err = refused(write(tmp_path, {**BASE, "zero_optimization": {"stage": 5}}))
    assert err.key == "zero_optimization.stage" and "set zero_optimization.stage to 3 in ds.json" in err.fix
    check(write(tmp_path, {**BASE, "zero_optimization": {"stage": 3}}))


def test_a_refused_file_exits_2_naming_the_key_without_a_traceback(tmp_path):
    proc = run_cli(f"deepspeed.config_file={CORPUS / 'unknown_gradient_clip.json'}", "accelerate.config_file=null",
                   f"hydra.run.dir={tmp_path}", timeout=180)
    assert proc.returncode == CONFIG_ERROR_EXIT and "Traceback" not in proc.stderr
    assert "`gradient_clip`" in proc.stderr and 'fix: rename "gradient_clip" to "gradient_clipping"' in proc.stderr
    assert read_summary(tmp_path)["error"]["key"] == "gradient_clip"

"""Configs users bring: DeepSpeed JSON files and accelerate YAMLs, as public repositories write them.

tests/data/ds_configs/expected.yaml says what must happen to each file; every file is checked here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LLAMAFACTORY_OFFLOAD
from tests.helpers.cli import ROOT, call_main, compose_cfg, preflight, read_summary, run_cli
from tests.helpers.ds_corpus import CORPUS, EXPECTED, QUICK, file_override
from zerotune.cli.ds_config import main as ds_config_main
from zerotune.cli.import_config import main as import_config_main
from zerotune.config import accelerate_file
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.host.ops import needed_ops
from zerotune.host.platform import Platform
from zerotune.rundir.summary import key_choices

SIMULATED_CUDA = Platform("cuda", True, "", bf16=True, fp16=True)
# The CPU run in the default suite: LLaMA-Factory's stage-3 offload file (DeepSpeed's CPU Adam, and keys DeepSpeed
# does not read, each warned of once), trained once for this module and tests/test_resolved.py (conftest's
# llamafactory_offload_run). Every other accepted file trains in the slow suite; its fast sibling is
# test_every_file_is_settled_before_training, which runs DeepSpeed's own config parser on the final dict
# (preflight's validator) and checks in-process what the run's records show.
FAST_RUNS = {LLAMAFACTORY_OFFLOAD}
IGNORED_KEYS = {"comms_config", "monitor_config"}  # DeepSpeed does not read them: left out of the run's dict


def warned_keys(warnings: list[str]) -> list[str]:
    """The key each warning line names: 'f.json: "comms_config" is not ...', 'f.json: bfloat16 is a deprecated ...'."""
    return [re.match(r'\S+: (?:dropped )?"?([\w.]+)', line).group(1) for line in warnings]


def dotted(ds: dict, key: str):
    for part in key.split("."):
        ds = ds[part]
    return ds


def all_values(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from all_values(value)
    else:
        yield node


def test_corpus_covers_the_shapes_users_bring():
    files = {p.name for p in CORPUS.iterdir() if p.suffix in (".json", ".yaml") and p.name != "expected.yaml"}
    assert files == set(EXPECTED), "every file has an expected outcome, and every outcome a file"
    assert sum(f.endswith(".json") for f in files) >= 20 and sum(f.endswith(".yaml") for f in files) >= 3
    outcomes = {e["outcome"] for e in EXPECTED.values()}
    assert outcomes == {"accepted", "refused"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_file_is_settled_before_training(name, monkeypatch):
    """Accepted: the effective choices, the final dict, no "auto" left, and accelerate's plugin takes it.
    Refused: a ConfigError at the expected key (the CLI prints it without a traceback)."""
    expected = EXPECTED[name]
    monkeypatch.chdir(CORPUS)  # relative paths inside the files, as their authors run them
    cfg = compose_cfg(*file_override(name))
    platform = SIMULATED_CUDA if expected.get("platform") == "cuda" else None
    if expected["outcome"] == "refused":
        with pytest.raises(ConfigError) as err:
            preflight(cfg, platform=platform)
        assert err.value.key == expected["key"], str(err.value)
        if "fix" in expected:
            assert err.value.fix == expected["fix"]
        return
    checked = preflight(cfg, platform=platform)
    choices = key_choices(checked.config, checked.world_size)
    for key, value in expected.get("choices", {}).items():
        assert choices[key] == value, (key, choices)
    for key, value in expected.get("ds", {}).items():
        assert dotted(checked.ds_config, key) == value, key
    assert warned_keys(checked.config_warnings) == expected.get("warnings", [])
    assert checked.config_sources["values"]
    assert "auto" not in list(all_values(checked.ds_config))
    ds = checked.ds_config
    assert not set(ds) & IGNORED_KEYS
    if ds["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu":
        # the engine builds DeepSpeed's CPU Adam (what test_accepted_files_train_on_the_cpu sees run), not torch's
        assert ds["optimizer"]["type"] in ("Adam", "AdamW") and "CPUAdamBuilder" in needed_ops(ds, True)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * \
        choices["world_size"]
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(ds)))
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == ds["zero_optimization"]["stage"]


def cpu_runnable() -> list[str]:
    """The accepted files a CPU runs, but the one the default suite trains (FAST_RUNS)."""
    return sorted(n for n, e in EXPECTED.items()
                  if e["outcome"] == "accepted" and e.get("platform") == "cpu" and n not in FAST_RUNS)


def test_llamafactorys_offload_file_trains_on_the_cpu(llamafactory_offload_run):
    check_accepted_run(LLAMAFACTORY_OFFLOAD, *llamafactory_offload_run)


@pytest.mark.slow
@pytest.mark.parametrize("name", cpu_runnable())
def test_accepted_files_train_on_the_cpu(name, tmp_path):
    check_accepted_run(name, tmp_path, run_cli(*file_override(name), *QUICK, f"hydra.run.dir={tmp_path}", cwd=CORPUS))


def check_accepted_run(name: str, run_dir: Path, proc: subprocess.CompletedProcess) -> None:
    """What a user's accepted file trained: 2 steps, the file's choices, each ignored key warned of once."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = read_summary(run_dir)
    assert summary["status"] == "ok" and summary["steps"] == 2
    for key, value in EXPECTED[name].get("choices", {}).items():
        assert summary["choices"][key] == value, (key, summary["choices"])
    assert summary["config_sources"]["values"]
    assert warned_keys(summary["config_warnings"]) == EXPECTED[name].get("warnings", [])
    parent = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("[default_role")]
    for warning in summary["config_warnings"]:  # the job's process says each once (its workers, in their logs)
        assert sum(line.endswith(warning) for line in parent) == 1, warning
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert not set(ds) & IGNORED_KEYS  # left out: what DeepSpeed was given
    if ds["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu":
        assert summary["optimizer_class"] == "DeepSpeedCPUAdam"  # not torch's AdamW: the file's offload counts


def test_stage3_cpu_offload_file_reports_what_ran():
    """The effective config, not the command line's defaults: choices, offload handling, measurement."""
    cfg = compose_cfg(*file_override("hf_zero3_offload_auto.json"))
    checked = preflight(cfg)
    assert key_choices(checked.config, 1)["zero_stage"] == 3 and key_choices(checked.config, 1)["offload"] == "cpu"
    assert "torch_adam" not in checked.ds_config["optimizer"]["params"]  # DeepSpeed's CPU-Adam, not torch's
    assert checked.config_sources["values"]["zero_optimization"].startswith("file hf_zero3_offload_auto.json")


@pytest.mark.parametrize("name", ["batch_contradiction.json", "removed_amp.json", "accelerate_fsdp.yaml"])
def test_refused_files_exit_2_without_traceback(name, tmp_path):
    proc = run_cli(*file_override(name), *QUICK, f"hydra.run.dir={tmp_path}", timeout=180)
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert f"`{EXPECTED[name]['key']}`" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert read_summary(tmp_path)["error"]["key"] == EXPECTED[name]["key"]


# ---------------------------------------------------------------- precedence


def test_a_typed_value_that_contradicts_the_file_is_an_error():
    cfg = compose_cfg("zero_stage=2", *file_override("hf_zero3_offload_auto.json"))
    with pytest.raises(ConfigError) as err:
        preflight(cfg, overrides=["zero_stage=2"])
    assert err.value.key == "zero_stage.stage"
    assert "`zero_stage=2`" in err.value.problem and "hf_zero3_offload_auto.json" in err.value.problem
    assert "drop `zero_stage=2`" in err.value.fix


def test_a_typed_value_that_agrees_with_the_file_is_fine():
    cfg = compose_cfg("zero_stage=3", "offload=cpu", *file_override("hf_zero3_offload_auto.json"))
    checked = preflight(cfg, overrides=["zero_stage=3", "offload=cpu"])
    assert checked.ds_config["zero_optimization"]["stage"] == 3


def test_a_group_choice_does_not_pin_the_options_other_values():
    # optimizer=adam pins the optimizer's name, not its lr: the file's lr stands
    names = ["optimizer=adam", *file_override("dse_onecycle_bf16.json")]
    checked = preflight(compose_cfg(*names), overrides=names[:1])
    assert checked.ds_config["optimizer"]["params"]["lr"] == 0.001


def test_typed_lr_fills_auto_and_conflicts_with_a_number():
    auto = ["optimizer.lr=3e-5", *file_override("hf_zero2_offload_auto.json")]
    assert preflight(compose_cfg(*auto), overrides=auto[:1]).ds_config["optimizer"]["params"]["lr"] == 3e-5
    fixed = ["optimizer.lr=3e-5", *file_override("dse_warmup_decay.json")]
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*fixed), overrides=fixed[:1])
    assert err.value.key == "optimizer.lr" and "2e-4" not in err.value.fix


def test_typed_precision_fills_the_auto_precision_blocks():
    names = ["precision=bf16", *file_override("hf_zero2_offload_auto.json")]
    ds = preflight(compose_cfg(*names), overrides=names[:1]).ds_config
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["fp16"]["loss_scale_window"] == 1000  # the rest of the file's block is kept


def test_file_blocks_are_taken_whole(tmp_path):
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {
        "lr": 1e-3}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}))
    # data=digits' recipe is a cosine schedule with weight decay: none of it may leak into the file's blocks
    ds = preflight(compose_cfg(f"deepspeed.config_file={file}")).ds_config
    assert ds["optimizer"] == {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
    assert ds["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}


def test_an_unset_group_yields_to_the_file_and_is_recorded():
    cfg = compose_cfg(*file_override("zero3_cpu_offload_bf16.json"))
    checked = preflight(cfg)
    assert checked.config.zero_stage.stage == 3 and checked.config.offload.device == "cpu" and checked.config.precision.name == "bf16"
    assert checked.config_sources["origins"]["zero_stage.stage"] == "zero3_cpu_offload_bf16.json: zero_optimization.stage"
    assert checked.config_sources["values"]["train_batch_size"].startswith("derived")


@pytest.mark.parametrize(("processes", "accum"), [(1, 64), (2, 32), (4, 16)])
def test_two_batch_keys_determine_the_third_at_any_world_size(processes, accum):
    # DeepSpeedExamples' BERT: 4096 samples per step, 64 per GPU. The global batch stays 4096.
    cfg = compose_cfg(*file_override("dse_bert_lamb_fp16.json"), f"launch.num_processes={processes}")
    ds = preflight(cfg, platform=SIMULATED_CUDA).ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        4096, 64, accum)


def test_a_typed_batch_completes_a_file_that_gives_only_the_total(tmp_path):
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"train_batch_size": 32}))
    names = ["train.batch_size=8", f"deepspeed.config_file={file}"]
    ds = preflight(compose_cfg(*names), overrides=names[:1]).ds_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 4)
    names = ["train.batch_size=5", f"deepspeed.config_file={file}"]
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*names), overrides=names[:1])
    assert err.value.key == "train_batch_size" and "not a multiple" in err.value.problem


def test_legacy_keys_are_translated_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = compose_cfg(*file_override("legacy_cpu_offload.json"))
        checked = preflight(cfg)
    assert "cpu_offload: true is a deprecated DeepSpeed key" in caplog.text
    assert "cpu_offload" not in checked.ds_config["zero_optimization"]
    assert checked.config.offload.device == "cpu" and "torch_adam" not in checked.ds_config["optimizer"]["params"]


def test_nvme_file_with_a_real_folder_is_measured_there(tmp_path):
    data = json.loads((CORPUS / "dse_zero3_nvme_aio.json").read_text())
    for block in ("offload_optimizer", "offload_param"):
        data["zero_optimization"][block]["nvme_path"] = str(tmp_path / "swap")
    file = tmp_path / "nvme.json"
    file.write_text(json.dumps(data))
    cfg = compose_cfg(f"deepspeed.config_file={file}")
    checked = preflight(cfg)
    assert checked.config.offload.device == "nvme" and checked.config.offload.path == str(tmp_path / "swap")  # the sampler's folder
    assert checked.ds_config["aio"]["queue_depth"] == 32  # the file's aio block, whole


def test_ds_config_cli_says_where_each_value_came_from():
    proc = call_main(ds_config_main, "zero_stage=3", *file_override("llava_zero2.json")[:1])
    assert proc.returncode == CONFIG_ERROR_EXIT  # the file says stage 2
    proc = call_main(ds_config_main, "train.batch_size=4", *file_override("llava_zero2.json"))
    assert proc.returncode == 0, proc.stderr
    ds = json.loads(proc.stdout)
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_micro_batch_size_per_gpu"] == 4
    lines = {ln.split()[0]: ln for ln in proc.stderr.splitlines() if ln.startswith("  ")}
    assert "command line" in lines["train_micro_batch_size_per_gpu"]
    assert "file llava_zero2.json" in lines["zero_optimization"]
    assert "default" in lines["gradient_clipping"]


# ---------------------------------------------------------------- accelerate


def test_accelerate_default_location_is_read_and_reported(isolated_accelerate_config):
    default = accelerate_file.default_location()
    default.parent.mkdir(parents=True, exist_ok=True)
    default.write_text((CORPUS / "accelerate_reference.yaml").read_text())
    cfg = compose_cfg()
    checked = preflight(cfg)
    assert checked.config.zero_stage.stage == 1 and checked.config.train.grad_accum == 4 and checked.config.precision.name == "bf16"
    assert checked.config_sources["accelerate_config"] == [
        {"origin": "default_config.yaml", "how": "default location", "path": str(default)}]
    cfg = compose_cfg("accelerate.config_file=null")
    assert preflight(cfg).config_sources["accelerate_config"] == [] and cfg.zero_stage.stage == 2


@pytest.mark.parametrize("env", [{}, {"XDG_CACHE_HOME": "/tmp/xdg"}, {"HF_HOME": "~/hf", "XDG_CACHE_HOME": "/x"}])
def test_the_default_location_is_accelerates_own(env, tmp_path):
    """zerotune computes accelerate's default config path without importing accelerate (which imports torch):
    the same path accelerate's own module gives, in a process of its own (it computes it at import)."""
    code = ("import json\nfrom accelerate.commands.config.config_args import default_config_file\n"
            "from zerotune.config.accelerate_file import default_location\n"
            "print(json.dumps([default_config_file, str(default_location())]))")
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "HOME": str(tmp_path), **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs, ours = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ours == theirs and ours.endswith("accelerate/default_config.yaml")


def test_accelerate_launch_environment_is_folded_in_and_hidden_from_accelerate(monkeypatch):
    # what `accelerate launch --config_file accelerate_zero3_offload.yaml` exports to each process
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
           "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "ACCELERATE_MIXED_PRECISION": "bf16",
           "ACCELERATE_CONFIG_DS_FIELDS": "gradient_accumulation_steps,offload_optimizer_device,"
                                          "offload_param_device,zero_stage,mixed_precision"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = compose_cfg()
    checked = preflight(cfg)
    assert (checked.config.zero_stage.stage, checked.config.offload.device, checked.config.train.grad_accum, checked.config.precision.name) == (3, "cpu", 2, "bf16")
    from accelerate.utils import DeepSpeedPlugin

    with pytest.raises(ValueError, match="will be ignored"):  # what killed the worker before
        DeepSpeedPlugin(hf_ds_config=dict(checked.ds_config))
    with accelerate_file.absorbed_launch_environment():
        DeepSpeedPlugin(hf_ds_config=dict(checked.ds_config))
    assert os.environ["ACCELERATE_CONFIG_DS_FIELDS"]  # restored afterwards
    with pytest.raises(ConfigError) as err:  # the command line may not contradict the launcher
        preflight(compose_cfg("zero_stage=2"), overrides=["zero_stage=2"])
    assert err.value.key == "zero_stage.stage" and "accelerate launch" in err.value.problem


def test_accelerate_yaml_and_its_deepspeed_file_must_agree(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                                       "  deepspeed_config_file: ds.json\n")
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(f"accelerate.config_file={tmp_path / 'acc.yaml'}"))
    assert err.value.key == "zero_stage.stage" and "acc.yaml" in err.value.problem and "ds.json" in err.value.problem


@pytest.mark.parametrize(("text", "needle"), [("distributed_type: DEEPSPEED\nbogus_key: 1\n", "unknown keys"),
                                              ("distributed_type: [DEEPSPEED\n", "not valid YAML")])
def test_broken_accelerate_yaml_is_a_config_error(tmp_path, text, needle):
    (tmp_path / "acc.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(f"accelerate.config_file={tmp_path / 'acc.yaml'}"))
    assert err.value.key == "accelerate.config_file" and needle in err.value.problem


@pytest.mark.slow
def test_accelerate_launch_with_the_reference_yaml_trains(tmp_path):
    """`accelerate launch --config_file <the guide's YAML> train.py`: the user's path, end to end."""
    import shutil
    import subprocess
    import sys

    from tests.helpers.cli import cli_env

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    proc = subprocess.run([accelerate, "launch", "--config_file", str(CORPUS / "accelerate_reference.yaml"),
                           str(ROOT / "train.py"), *QUICK, "scheduler=constant", "train.batch_size=8",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["status"] == "ok"
    assert (summary["choices"]["zero_stage"], summary["choices"]["grad_accum"], summary["choices"]["precision"]) == (
        1, 4, "bf16")
    assert summary["config_sources"]["accelerate_config"][0]["how"] == "environment"


# ---------------------------------------------------------------- import_config


@pytest.mark.parametrize("name", ["accelerate_reference.yaml", "dse_onecycle_bf16.json", "legacy_cpu_offload.json"])
def test_import_config_prints_equivalent_overrides(name):
    from zerotune.plan.import_config import overrides_for

    overrides, file_needed_for = overrides_for(CORPUS / name)
    via_file = preflight(compose_cfg(*file_override(name)), platform=SIMULATED_CUDA).ds_config
    via_overrides = preflight(compose_cfg(*overrides), platform=SIMULATED_CUDA).ds_config
    assert via_overrides == via_file
    assert any(o.startswith("deepspeed.config_file=") for o in overrides) == bool(file_needed_for)


def test_import_config_cli_saves_an_experiment_in_the_users_folder(tmp_path, monkeypatch):
    name = "imported_test_tmp"
    target = tmp_path / "zerotune" / "experiment" / f"{name}.yaml"  # ./zerotune/ of the folder it ran in
    proc = run_cli("import-config", str(CORPUS / "accelerate_reference.yaml"), "--save", name, module="zerotune",
                   cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["zero_stage=1", "precision=bf16", "launch.nnodes=1", "launch.node_rank=0",
                                   "launch.num_processes=1", "train.grad_accum=4", "accelerate.config_file=null"]
    assert target.is_file() and f"wrote {target}" in proc.stderr
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg(f"experiment={name}")
    assert (cfg.zero_stage.stage, cfg.precision.name, cfg.train.grad_accum) == (1, "bf16", 4)
    again = call_main(import_config_main, str(CORPUS / "accelerate_reference.yaml"), "--save", name)
    assert again.returncode == CONFIG_ERROR_EXIT and "--force" in again.stderr


@pytest.mark.parametrize("name", ["../outside", "a/b", ".hidden"])
def test_import_config_refuses_a_save_name_that_leaves_the_experiments_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = call_main(import_config_main, str(CORPUS / "accelerate_reference.yaml"), "--save", name)
    assert proc.returncode == CONFIG_ERROR_EXIT and "`--save`" in proc.stderr and "path separators" in proc.stderr
    assert not (tmp_path / "zerotune").exists() and not (tmp_path / "outside.yaml").exists()


def test_import_config_refuses_what_zerotune_refuses():
    proc = call_main(import_config_main, str(CORPUS / "removed_amp.json"))
    assert proc.returncode == CONFIG_ERROR_EXIT and "`amp`" in proc.stderr and "Traceback" not in proc.stderr

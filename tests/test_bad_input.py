"""Bad inputs that used to reach a worker (and a traceback there, 10-40 s in) stop in the job's parent's checks,
in seconds: exit 2, one message naming the key and the fix, and no training. The workers, started beside the
checks (job/gate.py), are turned away at the gate, mid-import: they leave nothing behind."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.cli import compose_cfg, preflight, run_cli
from tests.helpers.fixes import check_fix
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.config.search import packaged_conf
from zerotune.data import GIB, check_fits_memory
from zerotune.data.spec import DataSpec
from zerotune.models import build_network, check_pretrained, downsample_factor
from zerotune.plan.deepspeed import check_nvme_path
from zerotune.rundir.loggers import check_logger

FAST = ("train.max_steps=2", "evaluate.enabled=false")


def plan_error(*overrides: str) -> ConfigError:
    """The error preflight stops with; its fix line is applied, and must pass (tests/helpers/fixes.py)."""
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*overrides), overrides=list(overrides))
    check_fix(err.value, list(overrides), lambda fixed: preflight(compose_cfg(*fixed), overrides=fixed))
    return err.value


def refused_before_workers(key: str, *overrides: str, run_dir: Path) -> str:
    """Run the CLI; it must exit 2 naming `key`, without a traceback, and without training: no worker got past
    the gate (no step, no metrics, no rank record, no checkpoint), none is left running, and summary.json
    names the key."""
    start = time.monotonic()
    proc = run_cli(*overrides, *FAST, f"hydra.run.dir={run_dir}", timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr[-2000:]
    assert f"config error at `{key}" in proc.stderr and "Traceback" not in proc.stderr
    output = proc.stdout + proc.stderr
    assert "step 1/" not in output and "ChildFailedError" not in output and "exitcode" not in output
    for trained in ("metrics.jsonl", "ranks", "checkpoints", "ds_config.json"):
        assert not (run_dir / trained).exists(), trained
    assert not list(run_dir.glob(".gate-*")), "the gate's file is removed with the job"
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["error"]["key"].startswith(key) and summary["status"] == "failed"
    assert took < 60, took  # composition and checks only; a worker's start-up alone took 10-40 s
    assert plan_error(*overrides).key.startswith(key)  # the same refusal in-process, where its fix is applied
    return proc.stderr


# 1. train.seed


@pytest.mark.parametrize("seed", [-5, 2**32])
def test_seed_outside_numpy_range(seed):
    err = plan_error(f"train.seed={seed}")
    assert err.key == "train.seed" and "2**32 - 1" in err.problem and str(seed) in err.problem


def test_largest_seed_is_accepted():
    preflight(compose_cfg(f"train.seed={2**32 - 1}"))


def test_cli_negative_seed(tmp_path):
    refused_before_workers("train.seed", "train.seed=-5", run_dir=tmp_path / "run")


# 2. model.pretrained


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    """The tiny model's weights, as a diffusers folder and as one safetensors file."""
    root = tmp_path_factory.mktemp("weights")
    unet = build_network(compose_cfg().model)
    unet.save_pretrained(root / "unet")
    save_file(unet.state_dict(), str(root / "unet.safetensors"))
    return root


def pretrained_error(path) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        check_pretrained(compose_cfg(f"model.pretrained={path}").model)
    assert err.value.key == "model.pretrained"
    return err.value


@pytest.mark.parametrize("name", ["unet", ".", "unet.safetensors"])
def test_good_weights_pass(tiny_weights, name):
    check_pretrained(compose_cfg(f"model.pretrained={tiny_weights / name}").model)


def test_random_bytes_are_not_a_safetensors_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(os.urandom(4096))
    err = pretrained_error(tmp_path / "x.safetensors")
    assert "is not a safetensors file" in err.problem and "header" in err.problem


def test_truncated_file(tiny_weights, tmp_path):
    data = (tiny_weights / "unet.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    err = pretrained_error(tmp_path / "cut.safetensors")
    assert "is truncated" in err.problem and "copy the file again" in err.fix


def test_missing_path(tmp_path):
    assert "does not exist" in pretrained_error(tmp_path / "nope").problem


def test_keys_missing_and_shapes_differ_are_listed(tiny_weights, tmp_path):
    state = build_network(compose_cfg().model).state_dict()
    state.pop("conv_in.weight")
    state["conv_out.bias"] = torch.zeros(3)
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "other.safetensors"))
    err = pretrained_error(tmp_path / "other.safetensors")
    assert "does not match model=tiny" in err.problem
    assert "1 keys missing (e.g. conv_in.weight)" in err.problem and "extra.weight" in err.problem
    assert "conv_out.bias [3] (model: [1])" in err.problem


def test_weights_of_another_model_option(tiny_weights):
    cfg = compose_cfg("model=sdxl_tiny", "data=synthetic", f"model.pretrained={tiny_weights / 'unet.safetensors'}")
    with pytest.raises(ConfigError) as err:
        check_pretrained(cfg.model)
    assert "does not match model=sdxl_tiny" in err.value.problem and "keys missing" in err.value.problem


def test_folder_without_weights(tiny_weights, tmp_path):
    (tmp_path / "config.json").write_text((tiny_weights / "unet" / "config.json").read_text())
    err = pretrained_error(tmp_path)
    assert "no weights" in err.problem and "diffusion_pytorch_model.safetensors" in err.problem


def test_folder_with_broken_weights(tiny_weights, tmp_path):
    (tmp_path / "config.json").write_text((tiny_weights / "unet" / "config.json").read_text())
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 16)
    assert "is not a safetensors file" in pretrained_error(tmp_path).problem


def test_folder_without_config(tmp_path):
    assert "no config.json" in pretrained_error(tmp_path).problem


@pytest.mark.parametrize("pretrained", ["x.safetensors", "nonexistent"])
def test_cli_bad_pretrained(tmp_path, pretrained):
    (tmp_path / "x.safetensors").write_bytes(os.urandom(4096))
    stderr = refused_before_workers("model.pretrained", f"model.pretrained={tmp_path / pretrained}",
                                    run_dir=tmp_path / "run")
    assert ("not a safetensors file" if pretrained == "x.safetensors" else "does not exist") in stderr


# 3. resolution.size against this machine's memory


def spec(*overrides: str) -> DataSpec:
    return DataSpec.from_config(compose_cfg(*overrides))


@pytest.mark.parametrize("size", sorted(int(p.stem) for p in (packaged_conf() / "resolution").glob("*.yaml")))
@pytest.mark.parametrize("setup", [(), ("model=sdxl", "data=synthetic"), ("model=sdxl_tiny", "data=synthetic")])
def test_every_resolution_option_fits_a_16_gib_machine(size, setup):
    job = spec(*setup, f"resolution={size}")
    if size % (job.model.vae_scale_factor * downsample_factor(job.model)):
        pytest.skip(f"model={job.model.name} does not take {size} px (refused as such)")
    check_fits_memory(job, total=16 * GIB)


def test_huge_resolution_is_refused_with_the_estimate():
    with pytest.raises(ConfigError) as err:
        check_fits_memory(spec("resolution.size=100000"), total=16 * GIB)
    e = err.value
    assert e.key == "resolution.size" and "66,943.5 GiB" in e.problem and "16.0 GiB" in e.problem
    assert "1797 images" in e.problem and e.fix == "resolution.size=1544 or less"
    check_fits_memory(spec("resolution.size=1544"), total=16 * GIB)  # the size the fix names fits


def test_batch_of_latents_too_large_for_the_machine():
    with pytest.raises(ConfigError) as err:
        check_fits_memory(spec("model=sdxl", "data=synthetic", "resolution.size=65536"), total=16 * GIB)
    assert "one micro batch of 64 inputs (4x8192x8192 float32, 1.00 GiB each)" in err.value.problem
    assert "64.0 GiB" in err.value.problem and "or a smaller train.batch_size" in err.value.fix


def test_cli_huge_resolution(tmp_path):
    stderr = refused_before_workers("resolution.size", "resolution.size=100000", run_dir=tmp_path / "run")
    assert "GiB" in stderr and "psutil" in stderr


# 4. W&B online without an API key (nothing here reaches the network)


@pytest.fixture()
def no_wandb_login(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # wandb also reads ./wandb/settings
    wandb.teardown()  # settings are cached per process: reload them from this environment
    yield tmp_path
    wandb.teardown()


def logger_cfg(mode: str):
    return compose_cfg("logger=wandb", f"logger.mode={mode}").logger


def test_online_without_a_key(no_wandb_login):
    with pytest.raises(ConfigError) as err:
        check_logger(logger_cfg("online"))
    assert err.value.key == "logger.mode" and err.value.fix == "`wandb login`, or logger.mode=offline"


def test_online_with_a_key_in_the_environment_or_netrc(no_wandb_login, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_logger(logger_cfg("online"))
    monkeypatch.delenv("WANDB_API_KEY")
    from wandb.sdk import wandb_setup

    host = wandb_setup.singleton().settings.base_url.split("://")[1]
    (no_wandb_login / ".netrc").write_text(f"machine {host}\n  login user\n  password {'n' * 40}\n")
    (no_wandb_login / ".netrc").chmod(0o600)
    check_logger(logger_cfg("online"))


def test_malformed_key_is_refused(no_wandb_login, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(ConfigError, match="40"):
        check_logger(logger_cfg("online"))


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_local_modes_need_no_key(no_wandb_login, mode):
    check_logger(logger_cfg(mode))


def test_unknown_mode(no_wandb_login):
    with pytest.raises(ConfigError) as err:
        check_logger(logger_cfg("onlin"))
    assert err.value.key == "logger.mode" and "offline" in err.value.fix


def test_cli_online_without_a_key(no_wandb_login):
    stderr = refused_before_workers("logger.mode", "logger=wandb", "logger.mode=online",
                                    run_dir=no_wandb_login / "run")
    assert "fix: `wandb login`, or logger.mode=offline" in stderr


# 5. closed config groups offer their choices only


@pytest.mark.parametrize(("override", "choices"), [("zero_stage=5", "0, 1, 2, 3"), ("offload=gpu", "cpu, none, nvme"),
                                                   ("precision=fp8", "bf16, fp16, fp32")])
def test_closed_group_suggests_no_new_yaml(override, choices):
    with pytest.raises(ConfigError) as err:
        compose_cfg(override)
    assert err.value.fix == f"choose one of: {choices}"


def test_open_group_still_suggests_a_yaml():
    with pytest.raises(ConfigError) as err:
        compose_cfg("scheduler=linear")
    assert "add zerotune/scheduler/linear.yaml" in err.value.fix


def test_cli_zero_stage_5():
    proc = run_cli("zero_stage=5", timeout=60)
    assert proc.returncode == CONFIG_ERROR_EXIT
    assert "fix: choose one of: 0, 1, 2, 3\n" in proc.stderr and "conf/zero_stage" not in proc.stderr


@pytest.mark.parametrize("sweep", [(), ("-m",)])
def test_cli_override_hydra_cannot_read(tmp_path, sweep):
    run_dir = tmp_path / "run"
    proc = run_cli(*sweep, "train.max_steps=[1", f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}", timeout=60)
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr
    assert "config error at `train.max_steps`: Hydra cannot read `train.max_steps=[1`" in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_a_single_runs_composition_errors_are_raised_until_its_task_starts(monkeypatch):
    from zerotune.cli import train

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with train._composition_errors_raised():
        assert os.environ["HYDRA_FULL_ERROR"] == "1"  # Hydra raises what it cannot compose, for _main to report
        train._task_started()
        assert "HYDRA_FULL_ERROR" not in os.environ  # the job's own failures are Hydra's to report; no worker sees it
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the user's own setting is left alone
    with train._composition_errors_raised():
        train._task_started()
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


# 6. the NVMe folder: the real reason it cannot be used


def test_nvme_folder_under_proc_says_why():
    with pytest.raises(ConfigError) as err:
        check_nvme_path("/proc/zt", "offload.path")
    problem = err.value.problem
    assert problem.startswith("/proc/zt cannot be created in /proc: No such file or directory")
    assert "proc file system" in problem and "not writable" not in problem
    assert not Path("/proc/zt").exists()


def test_nvme_folder_created_by_the_check_is_removed(tmp_path):
    assert check_nvme_path(str(tmp_path / "swap"), "offload.path") == tmp_path / "swap"
    assert not (tmp_path / "swap").exists() and list(tmp_path.iterdir()) == []


def test_cli_nvme_under_proc(tmp_path):
    stderr = refused_before_workers("zero_optimization.offload_optimizer.nvme_path", "offload=nvme", "zero_stage=3",
                                    "offload.path=/proc/zt", run_dir=tmp_path / "run")
    assert "/proc/zt cannot be created in /proc" in stderr

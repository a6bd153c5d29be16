"""What the command line refuses before a job starts, each with its fix applied to show the fix works: an
interpolation that does not resolve, a run or sweep folder that cannot be created, and HYDRA_FULL_ERROR
set to anything but 1 in the user's shell."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from tests.helpers.cli import compose_cfg, run_cli
from zerotune.cli import callbacks
from zerotune.cli.callbacks import check_run_dir
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError

PLAN_ONLY = "plan.only=true"  # composes, checks, plans and writes the run's records, without training


def refused(proc, key: str) -> str:
    """The message of a CLI run that must stop with exit 2 at `key`, without a traceback; its fix line."""
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr[-2000:]
    assert f"zerotune: config error at `{key}`" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    return fix_of(proc.stderr)


def fix_of(stderr: str) -> str:
    return next(line.split("fix: ", 1)[1] for line in stderr.splitlines() if line.strip().startswith("fix: "))


# Interpolations typed on the command line


def test_an_interpolation_of_the_wrong_type_is_a_config_error_naming_its_key(tmp_path):
    proc = run_cli("train.seed=${oc.env:HOME}", PLAN_ONLY, f"hydra.run.dir={tmp_path / 'run'}")
    fix = refused(proc, "train.seed")
    assert "does not resolve" in proc.stderr and "could not be converted to Integer" in proc.stderr
    assert fix == "type the value itself: train.seed=<int>, e.g. train.seed=0"
    applied = run_cli(fix.rsplit("e.g. ", 1)[1], PLAN_ONLY, f"hydra.run.dir={tmp_path / 'fixed'}")
    assert applied.returncode == 0, applied.stderr[-2000:]


def test_a_missing_environment_variable_names_it_and_setting_it_fixes_it(monkeypatch):
    monkeypatch.delenv("ZEROTUNE_TEST_DATA", raising=False)
    with pytest.raises(ConfigError) as err:
        compose_cfg("data=folder", "data.path=${oc.env:ZEROTUNE_TEST_DATA}")
    assert err.value.key == "data.path"
    assert err.value.problem.endswith("the environment has no ZEROTUNE_TEST_DATA")
    assert err.value.fix.startswith("set ZEROTUNE_TEST_DATA in the environment")
    monkeypatch.setenv("ZEROTUNE_TEST_DATA", "/data/images")
    assert compose_cfg("data=folder", "data.path=${oc.env:ZEROTUNE_TEST_DATA}").data.path == "/data/images"


def test_every_job_of_a_sweep_is_checked_for_interpolations_before_the_first_starts(tmp_path):
    proc = run_cli("-m", "train.seed=1,${oc.env:HOME}", PLAN_ONLY, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    refused(proc, "train.seed")
    assert not (tmp_path / "sweep").exists()


def test_interpolations_that_resolve_still_work():
    cfg = compose_cfg("train.seed=${train.grad_accum}", "train.grad_accum=3")
    assert cfg.train.seed == 3


# The run and sweep folders


def test_a_run_folder_naming_an_existing_file_is_refused_and_the_file_left_alone(tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    proc = run_cli(PLAN_ONLY, f"hydra.run.dir={existing}")
    fix = refused(proc, "hydra.run.dir")
    assert f"{existing} is an existing file" in proc.stderr
    assert existing.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert fix == f"hydra.run.dir={tmp_path / 'notes.txt-run'}"
    applied = run_cli(PLAN_ONLY, fix)
    assert applied.returncode == 0, applied.stderr[-2000:]
    assert (tmp_path / "notes.txt-run" / "summary.json").is_file()


def test_a_run_folder_under_a_file_is_refused_even_for_a_run_that_is_refused_anyway(tmp_path):
    existing = tmp_path / "a-file"
    existing.write_text("")
    # zero_stage=2 with parameter offload is a config error too; the folder is what is found first.
    proc = run_cli(PLAN_ONLY, "offload=cpu", "offload.params=true", f"hydra.run.dir={existing / 'run'}")
    fix = refused(proc, "hydra.run.dir")
    assert f"{existing} is a file, so {existing / 'run'} cannot be created under it" in proc.stderr
    assert problem_gone("hydra.run.dir", fix)


def test_a_sweep_folder_that_cannot_be_written_is_refused_before_any_job():
    proc = run_cli("-m", "train.seed=1,2", PLAN_ONLY, "hydra.sweep.dir=/proc/zerotune-sweep")
    fix = refused(proc, "hydra.sweep.dir")
    assert "no file can be created in /proc" in proc.stderr and "proc file system" in proc.stderr
    assert fix.startswith("hydra.sweep.dir=") and problem_gone("hydra.sweep.dir", fix)


def test_a_full_disk_is_refused_naming_the_free_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    full = tmp_path.absolute()
    monkeypatch.setattr(callbacks.shutil, "disk_usage",
                        lambda p: usage(1 << 30, 1 << 30, 1024) if Path(p) == full else real(p))
    with pytest.raises(ConfigError) as err:
        check_run_dir("hydra.run.dir", str(tmp_path / "run"))
    assert err.value.key == "hydra.run.dir" and "has 0.0 MiB free; a run needs 16 MiB" in err.value.problem
    assert not (tmp_path / "run").exists()
    assert problem_gone("hydra.run.dir", err.value.fix)


def test_a_writable_run_folder_passes_and_nothing_is_left_by_the_check(tmp_path):
    check_run_dir("hydra.run.dir", str(tmp_path / "a" / "b"))
    check_run_dir("hydra.run.dir", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def problem_gone(key: str, fix: str) -> bool:
    name, _, folder = fix.partition("=")
    assert name == key, fix
    check_run_dir(key, folder)  # raises if the fix's folder has a problem of its own
    return True


# HYDRA_FULL_ERROR


@pytest.mark.parametrize("value", ["0", "", "true"])
def test_hydra_full_error_other_than_1_still_gets_zerotunes_config_error(value, tmp_path):
    env = {"HYDRA_FULL_ERROR": value}
    proc = run_cli("train.batch_size=abc", PLAN_ONLY, f"hydra.run.dir={tmp_path / 'run'}", env=env)
    fix = refused(proc, "train.batch_size")
    assert fix == "train.batch_size=<int>, e.g. train.batch_size=64"


def test_the_users_hydra_full_error_is_put_back_for_the_job(monkeypatch):
    from zerotune.cli import train

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    with train._composition_errors_raised():
        assert os.environ["HYDRA_FULL_ERROR"] == "1"  # Hydra reads only "1" as set
        train._task_started()
        assert os.environ["HYDRA_FULL_ERROR"] == "0"  # the job and its workers see the user's own value
    assert os.environ["HYDRA_FULL_ERROR"] == "0"


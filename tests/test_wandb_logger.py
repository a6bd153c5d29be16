"""WandbLogger in offline mode, verified by reading the run's .wandb records back."""

from __future__ import annotations

import os

import pytest

from zerotune.rundir import run_name
from zerotune.rundir.loggers import NullLogger, RunLogger

wandb = pytest.importorskip("wandb")

from tests.helpers.wandb_records import find_offline_run, read_offline_run  # noqa: E402
from zerotune.rundir.loggers import WandbLogger  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_wandb(tmp_path, monkeypatch):
    """Keep wandb off the network and out of ~/ (settings, cache, artifacts, netrc)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var, sub in [("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.fixture()
def png(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    fig.subplots().plot([0, 1], [1, 0])
    path = tmp_path / "sample.png"
    fig.savefig(path)
    return str(path)


CONFIG = {"zero_stage": 2, "offload": "cpu", "optim": {"lr": 1e-4, "betas": [0.9, 0.999]}}


def test_offline_run_round_trip(tmp_path, png):
    run_dir = tmp_path / "run"
    logger = WandbLogger(
        project="zerotune-test", run_dir=run_dir, config=CONFIG,
        name="zero_stage=2,offload=cpu", group="sweep-1", tags=("ci", "cpu"),
    )
    assert isinstance(logger, RunLogger)
    logger.log_metrics({"loss/train": 0.5, "train/lr": 1e-4}, step=0)
    # a second call for the same step merges into the same row
    logger.log_metrics({"memory/host_rss_mib": 1234.5, "memory/gpu_process_mib": None}, step=0)
    logger.log_metrics({"loss/train": 0.25, "perf/step_time_s": 0.31}, step=1)
    logger.log_images("samples", [png], step=1)
    logger.log_summary({"memory": {"host_peak_rss_mib": 2048.25}, "perf": {"samples_per_s": 12.5}, "ok": True})
    logger.finish()
    logger.finish()  # second call is a no-op

    run = read_offline_run(run_dir)
    assert run["path"].startswith(str(run_dir / "wandb" / "offline-run-"))
    assert run["name"] == "zero_stage=2,offload=cpu"
    assert run["group"] == "sweep-1"
    assert run["project"] == "zerotune-test"
    assert run["tags"] == ["ci", "cpu"]
    assert run["config"] == CONFIG
    assert run["exit_code"] == 0

    rows = {r["_step"]: r for r in run["history"]}
    assert sorted(rows) == [0, 1]
    assert rows[0]["loss/train"] == 0.5 and rows[0]["train/lr"] == 1e-4
    assert rows[0]["memory/host_rss_mib"] == 1234.5
    assert rows[0]["memory/gpu_process_mib"] is None  # null is logged as null, not dropped or zeroed
    assert rows[1]["loss/train"] == 0.25 and rows[1]["perf/step_time_s"] == 0.31
    image = rows[1]["samples"]
    assert image["_type"] == "images/separated" and image["count"] == 1
    media = os.path.join(os.path.dirname(run["path"]), "files", image["filenames"][0])
    assert os.path.getsize(media) > 0

    summary = run["summary"]
    assert summary["memory/host_peak_rss_mib"] == 2048.25  # nested dicts flattened with "/"
    assert summary["perf/samples_per_s"] == 12.5
    assert summary["ok"] is True
    assert summary["loss/train"] == 0.25  # wandb's own last-value summary is there too


def test_exit_code_and_context_manager(tmp_path):
    with pytest.raises(ValueError), WandbLogger("zerotune-test", tmp_path / "a", {}, "a", None) as logger:
        logger.log_metrics({"loss/train": 1.0}, step=0)
        raise ValueError("training crashed")
    assert read_offline_run(tmp_path / "a")["exit_code"] == 1

    logger = WandbLogger("zerotune-test", tmp_path / "b", {"x": 1}, "b", None)
    logger.finish(exit_code=3)
    logger.finish(exit_code=0)  # already finished: must not overwrite or raise
    logger.log_metrics({"loss/train": 1.0}, step=5)  # after finish: ignored, not an error
    run = read_offline_run(tmp_path / "b")
    assert run["exit_code"] == 3 and run["group"] == "" and run["history"] == []


def test_find_offline_run_requires_a_run(tmp_path):
    with pytest.raises(FileNotFoundError):
        find_offline_run(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["zero_stage=2", "offload=cpu"], "zero_stage=2,offload=cpu"),
        ([], "default"),
        (["model=unet/small", "+exp=a b"], "model=unet-small,+exp=a_b"),
        (["~ds.nvme_path", "lr=1e-4"], "_ds.nvme_path,lr=1e-4"),
    ],
)
def test_run_name_from_overrides(overrides, expected):
    assert run_name(overrides) == expected


def test_long_run_names_are_cut_but_distinct():
    a = run_name([f"key{i}=value{i}" for i in range(40)])
    b = run_name([f"key{i}=value{i}" for i in range(41)])
    assert len(a) <= 100 and len(b) <= 100 and a != b
    assert a.startswith("key0=value0,key1=value1")


def test_only_rank_0_with_logger_wandb_talks_to_wandb(tmp_path):
    from tests.helpers.cli import compose_cfg
    from zerotune.rundir.loggers import make_logger

    run = tmp_path / "run"
    run.mkdir()
    assert isinstance(make_logger(compose_cfg(), str(run), "r", None, is_main=True), NullLogger)
    other_rank = make_logger(compose_cfg("logger=wandb"), str(run), "r", None, is_main=False)
    assert isinstance(other_rank, NullLogger)
    assert not any(run.iterdir())  # neither wrote anything

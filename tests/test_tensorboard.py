"""logger=tensorboard and logger=all: every figure of metrics.jsonl, step for step, and the validation images in
TensorBoard's event files, read back with tensorboard's own EventAccumulator; W&B's offline run beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.cli import compose_cfg, read_summary, run_cli
from tests.helpers.fixes import refused_with_fixes
from tests.helpers.folder_fixtures import make_folder
from zerotune.config.errors import ConfigError
from zerotune.rundir.loggers import TENSORBOARD_DIR

PROMPTS = 'validation.prompts=["a red dog","a blue cat"]'


def _events(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = list((run / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(found) == 1, found
    events = EventAccumulator(str(found[0]), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def _figures(run: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's numbers: {key: {step: value}} (null, an unmeasured figure, is none)."""
    out: dict[str, dict[int, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out.setdefault(key, {})[row["step"]] = float(value)
    return out


def _train(run: Path, *args: str, env: dict | None = None) -> Path:
    proc = run_cli(*args, f"hydra.run.dir={run}", env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_summary(run)["status"] == "ok"
    return run


def _check_scalars(run: Path) -> None:
    events, figures = _events(run), _figures(run)
    assert figures and set(figures) <= set(events.Tags()["scalars"]), set(figures) - set(events.Tags()["scalars"])
    for key, by_step in figures.items():
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert logged.keys() == by_step.keys(), key
        for step, value in by_step.items():  # TensorBoard keeps float32
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)


def test_zero3_validation_writes_every_figure_and_image(tmp_path, tiny_sdxl_components):
    folder = make_folder(tmp_path / "images")
    run = _train(tmp_path / "run", "model=sdxl_tiny", "data=folder", f"data.path={folder}",
                 f"model.components={tiny_sdxl_components}", "resolution.size=64", "train.batch_size=2",
                 "train.max_steps=2", "train.log_every=1", f"data.cache_dir={tmp_path / 'cache'}", "zero_stage=3",
                 PROMPTS, "validation.steps=2", "logger=tensorboard")
    _check_scalars(run)
    events = _events(run)
    images = {tag: [e.step for e in events.Images(tag)] for tag in events.Tags()["images"]}
    # each prompt at the start and the end; `samples`: the run's telemetry plot, at its last step
    assert images == {"validation/00-a-red-dog": [0, 2], "validation/01-a-blue-cat": [0, 2], "samples": [2]}
    first = events.Images("validation/00-a-red-dog")[0]
    assert (first.width, first.height) == (64, 64)
    assert {"config", "summary"} <= {t.split("/")[0] for t in events.Tags()["tensors"]}  # the text plugin's


def test_all_logs_to_wandb_and_tensorboard_at_zero2(tmp_path):
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb-dir"),
                 "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                 "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    run = _train(tmp_path / "run", "model=tiny", "data=synthetic", "resolution=16", "train.batch_size=8",
                 "train.max_steps=4", "train.log_every=1", "zero_stage=2", "logger=all", env=wandb_env)
    _check_scalars(run)
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.parametrize("overrides,key", [(["logger.name=tensorbord"], "logger.name")])
def test_an_unknown_logger_is_refused_with_a_fix(overrides, key, tmp_path):
    err, fixes = refused_with_fixes(overrides, tmp_path)
    assert err.key == key and "unknown logger" in err.problem
    assert fixes == 4


def test_tensorboard_missing_is_named_before_any_worker(monkeypatch):
    import importlib.util

    from zerotune.rundir import loggers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        loggers.check_logger(compose_cfg("logger=tensorboard").logger)
    assert err.value.key == "logger" and "zerotune[tensorboard]" in err.value.fix

"""Validation prompts during training, end to end: model=sdxl_tiny on a captioned folder with the local tiny
components, at ZeRO-2 with CPU offload and at ZeRO-3 (with LoRA and an EMA compared side by side), through the CLI.

Each configuration trains twice, with validation and without: the loss curves must be bit-identical (a pass
consumes no training randomness and leaves no state behind)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.cli import read_losses, read_summary, run_cli
from tests.helpers.folder_fixtures import make_folder
from tests.helpers.pipelines import draw, exported_pipeline

PROMPTS = 'validation.prompts=["a red dog","a blue cat"]'
NAMES = ("00-a-red-dog", "01-a-blue-cat")
MAX_STEPS, EVERY = 4, 2
STEPS = (0, 2, 4)  # step 0 (the untrained baseline), every 2, the end


def _common(folder: Path, components: Path, cache: Path) -> list[str]:
    # A constant 1e-3 learning rate: the weights move enough in 4 steps for the images to change.
    return ["model=sdxl_tiny", "data=folder", f"data.path={folder}", f"model.components={components}",
            "resolution.size=64", f"train.max_steps={MAX_STEPS}", "train.batch_size=2", "train.log_every=1",
            "scheduler=constant", "optimizer.lr=1e-3", f"data.cache_dir={cache}"]


def _validation(*extra: str) -> list[str]:
    return [PROMPTS, f"validation.every_n_steps={EVERY}", "validation.steps=4", *extra]


def _train(run_dir: Path, *args: str, env: dict | None = None) -> Path:
    proc = run_cli(*args, f"hydra.run.dir={run_dir}", env={"OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    return run_dir


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def _wandb_env(root: Path) -> dict:
    """wandb offline, kept out of ~/ (as tests/test_wandb_logger.py's isolated_wandb)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root / "wandb-dir"),
            "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_CACHE_DIR": str(root / "wandb-cache"),
            "WANDB_DATA_DIR": str(root / "wandb-data")}


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory, tiny_sdxl_components):
    """ZeRO-2 with CPU offload, with validation logged to W&B offline (the same run without validation: the slow
    set's test_zero2_validation_leaves_the_loss_curve_bit_identical)."""
    root = tmp_path_factory.mktemp("validation_zero2")
    folder = make_folder(root / "images")
    common = [*_common(folder, tiny_sdxl_components, root / "cache"), "zero_stage=2", "offload=cpu"]
    return {"validated": _train(root / "validated", *common, *_validation(), "logger=wandb", env=_wandb_env(root)),
            "common": common, "components": tiny_sdxl_components}


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory, tiny_sdxl_components):
    """ZeRO-3 with LoRA and an EMA, validated with both weights side by side on a cold latent cache (its pass at
    step 2 runs out of memory), and the same run without validation on the cache the first one filled."""
    root = tmp_path_factory.mktemp("validation_zero3")
    folder, cache = make_folder(root / "images"), root / "cache"
    common = [*_common(folder, tiny_sdxl_components, cache), "zero_stage=3", "adapter=lora",
              "ema.enabled=true", "ema.warmup=false", "ema.decay=0.5", "checkpoint.final=false"]
    cold_cache = not cache.exists()
    validated = _train(root / "validated", *common, *_validation("validation.weights=comparison",
                                                                 "debug.validation_oom_at_step=2"))
    return {"validated": validated, "cold_cache": cold_cache, "filled": any(cache.rglob("*.safetensors")),
            "plain": _train(root / "plain", *common)}


def test_zero2_offload_samples_at_the_start_every_n_steps_and_the_end(zero2_runs):
    run = zero2_runs["validated"]
    record = read_summary(run)["validation"]
    assert [p["step"] for p in record["passes"]] == list(STEPS) and record["failed_passes"] == 0
    for step in STEPS:
        folder = run / "samples" / f"step-{step:07d}"
        assert sorted(p.name for p in folder.iterdir()) == sorted([f"{n}.png" for n in NAMES] + ["grid.png",
                                                                                                  "prompts.json"])
        assert _pixels(folder / f"{NAMES[0]}.png").shape == (64, 64, 3)
        index = json.loads((folder / "prompts.json").read_text())
        assert [p["prompt"] for p in index["prompts"]] == ["a red dog", "a blue cat"]
        assert [p["seed"] for p in index["prompts"]] == [0, 1]
        assert _pixels(folder / "grid.png").shape == (128, 64, 3)  # a row per prompt, one column (model weights)


def test_the_images_show_training(zero2_runs):
    first = zero2_runs["validated"]
    start = _pixels(first / "samples" / "step-0000000" / f"{NAMES[0]}.png")
    end = _pixels(first / "samples" / f"step-{MAX_STEPS:07d}" / f"{NAMES[0]}.png")
    assert np.abs(start - end).mean() > 1.0  # the trained weights sample something else
    # Different prompts and seeds give different images.
    other = _pixels(first / "samples" / "step-0000000" / f"{NAMES[1]}.png")
    assert not np.array_equal(start, other)


@pytest.mark.slow
def test_the_images_are_the_same_in_a_second_run(zero2_runs, tmp_path):
    """Every pass of a second identical run draws the same pixels (the fast set compares two runs' step 0:
    test_zero3_gathers_the_lora_model_and_compares_it_with_the_ema)."""
    again = _train(tmp_path / "again", *zero2_runs["common"], *_validation())
    for step in STEPS:
        for name in NAMES:
            folder = f"samples/step-{step:07d}/{name}.png"
            assert np.array_equal(_pixels(zero2_runs["validated"] / folder), _pixels(again / folder))


def test_validation_leaves_the_loss_curve_bit_identical(zero3_runs):
    """At ZeRO-3, where a pass gathers every partition and lifts the engine's hooks (its pass at step 2 failed:
    nothing of it stays either)."""
    losses = read_losses(zero3_runs["validated"])
    assert len(losses) == MAX_STEPS and losses == read_losses(zero3_runs["plain"])  # exact floats, every step


@pytest.mark.slow
def test_zero2_validation_leaves_the_loss_curve_bit_identical(zero2_runs, tmp_path):
    plain = _train(tmp_path / "plain", *zero2_runs["common"])
    losses = read_losses(zero2_runs["validated"])
    assert len(losses) == MAX_STEPS and losses == read_losses(plain)


def test_wandb_offline_holds_each_prompts_images_per_step(zero2_runs):
    from tests.helpers.wandb_records import read_offline_run

    record = read_offline_run(zero2_runs["validated"])
    assert record["exit_code"] == 0
    logged = {(row["_step"], key): row[key] for row in record["history"] for key in row
              if key.startswith("validation/")}
    assert sorted(logged) == sorted((step, f"validation/{n}") for step in STEPS for n in NAMES)
    files = os.path.join(os.path.dirname(record["path"]), "files")
    for (step, key), image in logged.items():
        assert image["_type"] == "images/separated" and image["count"] == 1
        media = os.path.join(files, image["filenames"][0])
        name = key.split("/", 1)[1]
        assert np.array_equal(_pixels(Path(media)),
                              _pixels(zero2_runs["validated"] / "samples" / f"step-{step:07d}" / f"{name}.png"))


def test_own_images_at_zero3_on_a_cold_cache(zero3_runs):
    """The frozen encoders load whole at ZeRO-3 (never partitioned under zero.Init), for the folder's captions and
    for the prompts: the first run fills an empty cache; the second reads the same latents from it (the same
    losses: test_validation_leaves_the_loss_curve_bit_identical)."""
    assert zero3_runs["cold_cache"] and zero3_runs["filled"]
    assert read_summary(zero3_runs["validated"])["data"]["cache"]["latents_computed"] == 11
    assert read_summary(zero3_runs["plain"])["data"]["cache"]["latents_reused"] == 11


def test_zero3_gathers_the_lora_model_and_compares_it_with_the_ema(zero2_runs, zero3_runs):
    run = zero3_runs["validated"]
    record = read_summary(run)["validation"]
    assert record["weights"] == ["model", "ema"]
    end = run / "samples" / f"step-{MAX_STEPS:07d}"
    assert _pixels(end / "grid.png").shape == (128, 128, 3)  # a column per weights
    model, ema = _pixels(end / f"{NAMES[0]}.png"), _pixels(end / f"{NAMES[0]}-ema.png")
    assert not np.array_equal(model, ema)  # decay 0.5: the EMA lags the model
    # LoRA starts as the identity (B = 0) and the build is seeded the same at every stage: before training, the
    # gathered ZeRO-3 LoRA model samples exactly what the plain ZeRO-2 model of another run samples.
    start = "samples/step-0000000"
    for name in NAMES:
        assert np.array_equal(_pixels(run / start / f"{name}.png"),
                              _pixels(zero2_runs["validated"] / start / f"{name}.png"))
    trained = _pixels(end / f"{NAMES[0]}.png")
    assert np.abs(trained - _pixels(run / start / f"{NAMES[0]}.png")).mean() > 0.5  # the adapter was applied


def test_the_sampling_phase_is_planned_and_measured(zero2_runs, zero3_runs):
    for runs, gathered in ((zero2_runs, False), (zero3_runs, True)):
        summary = read_summary(runs["validated"])
        memory = summary["validation"]["memory"]
        terms = memory["planned_pass_terms"]
        assert ("unet_gathered_for_sampling" in terms) == gathered
        assert terms["vae_weights"] > 0 and terms["sampling_activations"] > 0
        assert memory["planned_pass_mib"] == pytest.approx(sum(terms.values()))
        # On this CPU nothing is measured on a device: None, never 0; the host is measured.
        assert memory["measured_gpu_max_reserved_mib"] is None and memory["gpu_measured_over_planned"] is None
        assert memory["measured_host_peak_rss_mib"] > 0
        phases = [p["phase"] for p in summary["memory"]["phases"]]
        assert phases.count("sampling") == len(STEPS)


def test_the_export_generates_in_diffusers_sdxl_pipeline(zero2_runs, tmp_path):
    """The run's export, with the local components, is a StableDiffusionXLPipeline that draws from a prompt."""
    pipe = exported_pipeline(zero2_runs["validated"], zero2_runs["components"], tmp_path / "out")
    assert type(pipe).__name__ == "StableDiffusionXLPipeline"
    image = draw(pipe, "a red dog", negative_prompt="a blue cat")
    assert image.shape == (64, 64, 3) and np.isfinite(image).all() and image.std() > 0


def test_a_failed_pass_is_recorded_and_the_run_goes_on(zero3_runs):
    run = zero3_runs["validated"]
    record = read_summary(run)["validation"]
    assert [p["step"] for p in record["passes"]] == list(STEPS) and record["failed_passes"] == 1
    failed = record["passes"][1]
    assert [e["weights"] for e in failed["errors"]] == ["model", "ema"]
    assert all(e["out_of_memory"] and e["type"] == "OutOfMemoryError" for e in failed["errors"])
    assert not (run / "samples" / "step-0000002").exists()
    assert (run / "samples" / f"step-{MAX_STEPS:07d}" / f"{NAMES[0]}-ema.png").is_file()  # the next pass ran


@pytest.mark.parametrize("strict", [False, True])
def test_a_pass_that_runs_out_of_memory_is_recorded_or_under_strict_raised(strict, tmp_path, tiny_sdxl_components):
    """A pass on its own, in this process: the Validator with a tiny U-Net as the trainer holds it."""
    from types import SimpleNamespace

    import torch

    from tests.helpers.cli import compose_cfg
    from zerotune.data.prompts import check_validation
    from zerotune.models import build_network
    from zerotune.models.diffusion import noise_scheduler
    from zerotune.rundir import RunDir
    from zerotune.rundir.loggers import NullLogger
    from zerotune.train.validation import ValidationFailed, Validator

    cfg = compose_cfg("model=sdxl_tiny", "data=synthetic", f"model.components={tiny_sdxl_components}",
                      f"data.cache_dir={tmp_path / 'cache'}", "resolution.size=64", *_validation(),
                      "debug.validation_oom_at_step=2", f"validation.strict={strict}")
    unet = build_network(cfg.model)
    trained = SimpleNamespace(unet=unet, ema=None, noise_schedule=noise_scheduler(cfg.diffusion),
                              resolved=SimpleNamespace(zero_stage=2), trained_module=lambda: unet)
    validator = Validator(cfg, check_validation(cfg), RunDir(tmp_path / "run"), NullLogger(), torch.device("cpu"),
                          torch.float32, 0, 1)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    assert "errors" not in validator.run(0, trained)  # type: ignore[arg-type]
    if strict:
        with pytest.raises(ValidationFailed, match="validation.strict=false"):
            validator.run(2, trained)  # type: ignore[arg-type]
    else:
        record = validator.run(2, trained)  # type: ignore[arg-type]
        assert record["errors"][0]["out_of_memory"] and validator.summary()["failed_passes"] == 1
    assert unet.training and all(torch.equal(v, before[k]) for k, v in unet.state_dict().items())
    assert (tmp_path / "run" / "samples" / "step-0000000" / f"{NAMES[0]}.png").is_file()


@pytest.mark.slow
def test_under_strict_a_failed_pass_stops_the_run_keeping_what_came_before(tmp_path, tiny_sdxl_components):
    folder = make_folder(tmp_path / "images")
    proc = run_cli(*_common(folder, tiny_sdxl_components, tmp_path / "cache"), "checkpoint.final=false",
                   *_validation(), "debug.validation_oom_at_step=2", "validation.strict=true",
                   f"hydra.run.dir={tmp_path / 'strict'}", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    summary = read_summary(tmp_path / "strict")
    assert summary["status"] == "failed" and summary["error"]["type"] == "ValidationFailed"
    assert "validation.strict=false" in summary["error"]["message"]
    assert (tmp_path / "strict" / "samples" / "step-0000000" / f"{NAMES[0]}.png").is_file()
    assert len(read_losses(tmp_path / "strict")) == EVERY


def test_the_demo_puts_the_passes_side_by_side(zero2_runs, tmp_path):
    """experiments/validation_demo/progress.py (the picture in docs/validation.md): a row per prompt, a column per pass."""
    import subprocess
    import sys

    from tests.helpers.cli import ROOT

    out = tmp_path / "progress.png"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/validation_demo/progress.py"),
                           str(zero2_runs["validated"]), str(out), "--scale", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    label = 14  # a line of text above each row and above the columns
    assert Image.open(out).size == (64 * len(STEPS), (64 + label) * len(NAMES) + label)


@pytest.mark.slow
def test_two_processes_at_zero3_sample_their_shares_as_one_process_does(tmp_path, tiny_sdxl_components):
    """Each rank samples every second prompt inside the gathered ZeRO-3 model; rank 0 writes them all. At one
    thread per process (a kernel's sums depend on its thread count) the pixels are one process's."""
    folder = make_folder(tmp_path / "images")
    args = [*_common(folder, tiny_sdxl_components, tmp_path / "cache"), "zero_stage=3", "train.max_steps=1",
            "checkpoint.final=false", 'validation.prompts=["a red dog","a blue cat","a photo"]', "validation.steps=4",
            "launch.threads=1"]
    two = _train(tmp_path / "two", *args, "launch.num_processes=2")
    one = _train(tmp_path / "one", *args)
    names = ("00-a-red-dog", "01-a-blue-cat", "02-a-photo")
    for step in (0, 1):
        assert read_summary(two)["validation"]["passes"][step]["images"] == 3
        for name in names:
            folder = f"samples/step-{step:07d}/{name}.png"
            if step == 0:  # before training: the same weights (one process's batch differs from two's after)
                assert np.array_equal(_pixels(two / folder), _pixels(one / folder))
            assert (two / folder).is_file()

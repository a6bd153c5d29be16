"""SD 1.5 and SD 2.1 U-Nets (model=sd15, sd21; sd15_tiny for CPU runs): one text encoder's hidden states as the
only condition, v-prediction for 2.1. The architectures against the published parameter counts; data=folder with
validation prompts end to end on sd15_tiny, its export generating in diffusers' StableDiffusionPipeline; the
planner's breakdowns for both full-size models."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.cli import compose_cfg, preflight, read_summary, run_cli
from tests.helpers.folder_fixtures import make_folder
from tests.helpers.pipelines import draw, exported_pipeline
from zerotune.config.errors import ConfigError

# the diffusers unet/ folders of runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-2-1
PUBLISHED = {"sd15": 859_520_964, "sd21": 865_910_724}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_architecture_has_the_published_parameter_count(name):
    from zerotune.models import model_stats

    assert model_stats(compose_cfg(f"model={name}").model).num_params == PUBLISHED[name]


def test_sd21_predicts_v_and_sd15_epsilon():
    assert compose_cfg("model=sd21").diffusion.prediction_type == "v_prediction"
    assert compose_cfg("model=sd15").diffusion.prediction_type == "epsilon"


@pytest.mark.parametrize(("name", "size"), [("sd15", 512), pytest.param("sd21", 768, marks=pytest.mark.slow)])
def test_the_planner_covers_both(name, size):
    """`zerotune plan model=sd15 ...` and sd21 at 768: breakdowns with sources (sd21's cold trace is slow)."""
    from zerotune.plan import predict
    from zerotune.plan.gpus import lookup

    checked = preflight(compose_cfg(f"model={name}", f"resolution={size}", "precision=bf16", "train.batch_size=1",
                                    "zero_stage=2", "optimizer=adamw8bit", "train.gradient_checkpointing=true"))
    plan = predict.predict(checked, lookup("rtx4090"))
    terms = {t.term: t for t in plan.gpu_terms}
    assert terms["activations"].mib > 0 and "trace" in terms["activations"].note
    assert "Optimizer2State.init_state" in terms["optimizer_states"].note
    assert plan.run_peak_mib < 24 * 1024  # fits a 4090 (SD fine-tunes do: 8-bit states, checkpointing)


def test_a_missing_component_names_the_ones_sd_needs(tmp_path):
    make_folder(tmp_path / "images")
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg("model=sd15_tiny", "data=folder", f"data.path={tmp_path / 'images'}",
                              "resolution.size=64", "train.batch_size=1"))
    assert err.value.key == "model.vae" and "sd15_tiny_pipeline" in err.value.fix


@pytest.fixture(scope="module")
def sd15_run(tmp_path_factory):
    from tests.helpers.tiny_components import save_tiny_sd15_pipeline

    root = tmp_path_factory.mktemp("sd15")
    parts, folder = save_tiny_sd15_pipeline(root / "parts"), make_folder(root / "images")
    run_dir = root / "run"
    proc = run_cli("model=sd15_tiny", "data=folder", f"data.path={folder}", f"model.components={parts}",
                   "resolution.size=64", "train.max_steps=2", "train.batch_size=2", "scheduler=constant",
                   "optimizer.lr=1e-3", f"data.cache_dir={root / 'cache'}", 'validation.prompts=["a red dog"]',
                   "validation.steps=2", "validation.at_start=false", f"hydra.run.dir={run_dir}",
                   env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"run": run_dir, "parts": parts}


def test_sd15_trains_on_a_folder_and_samples_its_prompt(sd15_run):
    summary = read_summary(sd15_run["run"])
    assert summary["status"] == "ok" and summary["steps"] == 2
    assert summary["validation"]["failed_passes"] == 0
    assert (sd15_run["run"] / "samples/step-0000002/00-a-red-dog.png").is_file()


def test_the_export_generates_in_diffusers_sd_pipeline(sd15_run, tmp_path):
    pipe = exported_pipeline(sd15_run["run"], sd15_run["parts"], tmp_path / "out")
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    image = draw(pipe, "a red dog")
    assert image.shape == (64, 64, 3) and np.isfinite(image).all() and image.std() > 0


def test_the_default_digits_are_refused_before_any_worker_and_the_fix_works(tmp_path):
    """A job that would train refuses them (the workers could not load them); a plan of the model does not."""
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg("model=sd15_tiny", "resolution=32"), run_dir=tmp_path)
    assert err.value.key == "data" and "data=synthetic" in err.value.fix
    fixed = preflight(compose_cfg("model=sd15_tiny", "resolution=32", "data=synthetic"), run_dir=tmp_path)
    assert fixed.config.model.name == "sd15_tiny"
    assert preflight(compose_cfg("model=sd15_tiny", "resolution=32")).config.data.name == "digits"  # plan only

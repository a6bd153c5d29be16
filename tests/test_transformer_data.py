"""FLUX.1 and SD3 on a user's captioned images: their CLIP and T5 encoders and 16-channel-style VAE (tiny, built
here) loaded from a local pipeline folder, the condition cached with the latents as the pipelines make it, the
components checked against the transformer before anything loads, data.max_sequence_length, and validation
passes that draw what FluxPipeline / StableDiffusion3Pipeline draw."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.cli import compose_cfg, config_of, preflight, read_summary, run_cli
from tests.helpers.fixes import refused_with_fixes
from tests.helpers.folder_fixtures import noise_images
from zerotune.config.compose import compose_settled
from zerotune.config.errors import ConfigError
from zerotune.data.components import FrozenEncoders, resolve_components
from zerotune.data.prepare import prepare_folder_data
from zerotune.data.spec import DataSpec

CAPTIONS = ("a photo of a dog", "a red cat", "a blue dog", "a photo of a cat")


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Path]:
    """{"flux_tiny": folder, "sd3_tiny": folder}: each model's tiny frozen components, saved by its pipeline."""
    from tests.helpers.tiny_components import save_tiny_transformer_components

    root = tmp_path_factory.mktemp("transformer_parts")
    return {model: save_tiny_transformer_components(root / family, family,
                                                    dict(config_of(f"model={model}").model.scheduler))
            for model, family in (("flux_tiny", "flux"), ("sd3_tiny", "sd3"))}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """8 random 64x64 images, captioned by side-car files."""
    return noise_images(tmp_path_factory.mktemp("transformer_images"), CAPTIONS)


def _folder(model: str, parts: dict[str, Path], images: Path, cache: Path, *extra: str) -> list[str]:
    return [f"model={model}", "data=folder", f"data.path={images}", f"model.components={parts[model]}",
            "resolution=64", "train.batch_size=2", f"data.cache_dir={cache}", *extra]


def _spec(model: str, parts: dict[str, Path], images: Path, tmp_path: Path) -> DataSpec:
    return DataSpec.from_config(config_of(*_folder(model, parts, images, tmp_path / "cache")))


def _settled(*overrides: str):
    return compose_settled(list(overrides)).config


def _pipeline(model: str, folder: Path, transformer=None):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, transformer=transformer, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------------- the condition


@pytest.mark.parametrize("model,tokens,shape", [("flux_tiny", None, (16, 32)), ("flux_tiny", 5, (5, 32)),
                                                ("sd3_tiny", None, (16, 32)), ("sd3_tiny", 12, (20, 32))])
def test_the_condition_is_the_pipelines_own(model, tokens, shape, parts):
    """FrozenEncoders gives what the pipeline's encode_prompt gives, at the settled T5 length (FLUX.1: T5's tokens
    alone; SD3: CLIP's 8 ahead of them)."""
    extra = [f"data.max_sequence_length={tokens}"] if tokens else []
    cfg = _settled(f"model={model}", "data=synthetic", f"model.components={parts[model]}", *extra)
    assert cfg.model.text_seq_len == shape[0]
    hidden, pooled = FrozenEncoders(resolve_components(cfg.model), torch.device("cpu"), cfg.model).encode_text(
        list(CAPTIONS[:2]))
    pipe = _pipeline(model, parts[model])
    t5 = cfg.model.text_seq_len - cfg.model.clip_tokens
    if model == "flux_tiny":
        want, want_pooled, _ = pipe.encode_prompt(list(CAPTIONS[:2]), device="cpu", max_sequence_length=t5)
    else:
        want, _, want_pooled, _ = pipe.encode_prompt(list(CAPTIONS[:2]), None, None, device="cpu",
                                                     do_classifier_free_guidance=False, max_sequence_length=t5)
    assert hidden.shape == (2, *shape) and pooled is not None
    # the same calls; the pipeline loaded by DiffusionPipeline differs in float rounding alone
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled, want_pooled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model,pooled", [("flux_tiny", 32), ("sd3_tiny", 64)])
def test_folder_data_caches_latents_and_condition_and_reports_their_size(model, pooled, parts, images, tmp_path):
    dataset, report = prepare_folder_data(_spec(model, parts, images, tmp_path), progress=False)
    sample = dataset[0]
    assert set(sample) == {"x0", "encoder_hidden_states", "pooled_projections"}
    assert sample["x0"].shape == (4, 16, 16) and sample["encoder_hidden_states"].shape == (16, 32)
    assert sample["pooled_projections"].shape == (pooled,)
    assert report["cache"]["latents_computed"] == 8 and report["cache"]["texts_computed"] == len(CAPTIONS)
    names = ["text_encoder", "text_encoder_2"] + (["text_encoder_3"] if model == "sd3_tiny" else [])
    assert report["text_conditioning"] == dict.fromkeys(names, "embeddings")
    on_disk = {kind: sum(p.stat().st_size for p in (tmp_path / "cache" / kind).rglob("*.safetensors")) / 2**20
               for kind in ("latents", "text")}
    assert report["cache_mib"] == pytest.approx(on_disk, abs=1e-3) and report["cache_mib"]["text"] > 0
    # the VAE's shift and scale: the cached latent is the pipeline VAE's posterior mean, shifted and scaled
    vae = _pipeline(model, parts[model]).vae
    item = dataset.items[0]
    from zerotune.data.sources import crop_pixels, open_rgb

    pixels = crop_pixels(open_rgb(item.record.path), item.placement)[None]
    want = (vae.encode(pixels).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(sample["x0"], want[0].detach(), rtol=1e-5, atol=1e-5)
    _, again = prepare_folder_data(_spec(model, parts, images, tmp_path), progress=False)
    assert again["cache"]["latents_reused"] == 8 and again["cache"]["texts_reused"] == len(CAPTIONS)


@pytest.mark.parametrize("model,override,key", [
    ("flux_tiny", "model.transformer.joint_attention_dim=64", "model.text_encoder_2"),  # T5's width
    ("flux_tiny", "model.transformer.pooled_projection_dim=16", "model.text_encoder"),  # CLIP-L's pooled
    ("sd3_tiny", "model.clip_tokens=10", "model.tokenizer"),                             # CLIP's padding
])
def test_components_that_do_not_fit_the_transformer_are_refused_before_loading(model, override, key, parts, images,
                                                                               tmp_path):
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*_folder(model, parts, images, tmp_path / "cache"), override))
    assert err.value.key == key, err.value
    assert not (tmp_path / "cache").exists()  # nothing was encoded


def test_a_model_without_t5_refuses_max_sequence_length_with_a_fix(tmp_path):
    overrides = ["model=sd15_tiny", "data=synthetic", "data.max_sequence_length=128"]

    err, fixes = refused_with_fixes(overrides, tmp_path)
    assert err.key == "data.max_sequence_length" and "no T5" in err.problem
    assert fixes == 1


def test_the_planners_tiny_architectures_are_the_tiny_components(parts):
    """What the planner builds for flux_tiny and sd3_tiny without their folders (models/text_encoders.py BUILTIN) is
    what the tests' components are."""
    from zerotune.models.text_encoders import BUILTIN

    for model, folder in parts.items():
        for name, arch in BUILTIN[model][0].items():
            saved = json.loads((folder / name / "config.json").read_text())
            assert {k: saved[k] for k in arch} == arch, (model, name)


# ------------------------------------------------------------------------------- training and validation passes


def _saved_transformer(model: str, folder: Path) -> Path:
    from zerotune.models.backbones import backbone_of

    net = backbone_of(config_of(f"model={model}").model)
    torch.manual_seed(7)
    net.model_class()(**net.arguments()).save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def _validated_run(model: str, stage: str, offload: str, parts, images, tmp_path) -> tuple[Path, Path]:
    """A run from a saved random transformer, validated at step 0, after step 2 and at the end (step 3)."""
    pretrained = _saved_transformer(model, tmp_path / "pretrained")
    run = tmp_path / "run"
    proc = run_cli(*_folder(model, parts, images, tmp_path / "cache"), f"model.pretrained={pretrained}",
                   f"zero_stage={stage}", f"offload={offload}", "train.max_steps=3", "train.log_every=1",
                   "optimizer.lr=1e-2", "scheduler=constant",
                   'validation.prompts=["a photo of a dog"]', "validation.every_n_steps=2", "validation.steps=3",
                   "validation.seed=5", f"hydra.run.dir={run}", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, pretrained


def _step0(run: Path) -> tuple[np.ndarray, dict]:
    folder = run / "samples" / "step-0000000"
    prompt = json.loads((folder / "prompts.json").read_text())["prompts"][0]
    return _pixels(folder / prompt["files"]["model"]), prompt


def test_flux_validates_at_zero3_drawing_what_flux_pipeline_draws(parts, images, tmp_path):
    """At step 0 the weights are the pretrained transformer's: the pass's image is FluxPipeline's for the same
    prompt, seed, size, steps and guidance, with that transformer and the run's components."""
    from diffusers import FluxTransformer2DModel

    run, pretrained = _validated_run("flux_tiny", "3", "none", parts, images, tmp_path)
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["validation"]["failed_passes"] == 0
    assert [p["step"] for p in summary["validation"]["passes"]] == [0, 2, 3]
    image, p = _step0(run)
    pipe = _pipeline("flux_tiny", parts["flux_tiny"], FluxTransformer2DModel.from_pretrained(pretrained / "transformer"))
    want = pipe(p["prompt"], width=p["width"], height=p["height"], num_inference_steps=p["steps"],
                guidance_scale=p["guidance_scale"], max_sequence_length=16,
                generator=torch.Generator().manual_seed(p["seed"])).images[0]
    assert np.abs(image - _pixels_of(want)).max() <= 1
    later = _pixels(run / "samples" / "step-0000003" / f"{p['name']}.png")
    assert np.abs(later - image).max() > 1, "three steps of training changed nothing in the image"


@pytest.mark.slow
def test_sd3_validates_at_zero2_with_offload_drawing_what_its_pipeline_draws(parts, images, tmp_path):
    """SD3 guides against zeros (the null condition it trains on), handed to the pipeline as the negative."""
    from diffusers import SD3Transformer2DModel

    run, pretrained = _validated_run("sd3_tiny", "2", "cpu", parts, images, tmp_path)
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["validation"]["failed_passes"] == 0
    image, p = _step0(run)
    pipe = _pipeline("sd3_tiny", parts["sd3_tiny"], SD3Transformer2DModel.from_pretrained(pretrained / "transformer"))
    want = pipe(p["prompt"], width=p["width"], height=p["height"], num_inference_steps=p["steps"],
                guidance_scale=p["guidance_scale"], max_sequence_length=8,
                negative_prompt_embeds=torch.zeros(1, 16, 32), negative_pooled_prompt_embeds=torch.zeros(1, 64),
                generator=torch.Generator().manual_seed(p["seed"])).images[0]
    assert np.abs(image - _pixels_of(want)).max() <= 1


def _pixels_of(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB")).astype(np.int16)

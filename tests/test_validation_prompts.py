"""The validation block before training: prompt files as people write them (kohya's sample_prompts.txt,
SimpleTuner's prompt library, jsonl), and every bad setting refused naming its key with a fix that works."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import compose_cfg, preflight
from tests.helpers.folder_fixtures import make_folder
from tests.test_validation import plan_error
from zerotune.config.errors import ConfigError
from zerotune.config.schema import Validation
from zerotune.data.prompts import check_validation, load_prompts, weights_to_sample
from zerotune.rundir.loggers import NullLogger


def prompts_of(path, **settings):
    return load_prompts(Validation(prompt_file=str(path), **settings), (64, 64))


def test_a_kohya_prompt_file_keeps_each_lines_options(tmp_path):
    file = tmp_path / "sample_prompts.txt"
    file.write_text("# kohya's format\n\na red dog --n blurry, low quality --d 42 --w 128 --h 64 --l 7.5 --s 12\n"
                    "a blue cat\n")
    dog, cat = prompts_of(file, seed=10, steps=20, guidance_scale=5.0)
    assert (dog.prompt, dog.negative_prompt, dog.seed, dog.width, dog.height, dog.guidance_scale, dog.steps) == (
        "a red dog", "blurry, low quality", 42, 128, 64, 7.5, 12)
    # A line naming nothing takes the block's settings; its seed is validation.seed + its index.
    assert (cat.prompt, cat.negative_prompt, cat.seed, cat.width, cat.steps, cat.guidance_scale) == (
        "a blue cat", "", 11, 64, 20, 5.0)
    assert dog.name == "00-a-red-dog" and cat.name == "01-a-blue-cat"


def test_simpletuners_prompt_library_names_the_keys(tmp_path):
    file = tmp_path / "library.json"
    file.write_text(json.dumps({"dog portrait": "a red dog, studio light", "cat": "a blue cat"}))
    dog, cat = prompts_of(file)
    assert (dog.name, dog.prompt, cat.name, cat.prompt) == ("dog-portrait", "a red dog, studio light", "cat",
                                                            "a blue cat")


def test_jsonl_and_the_config_list_come_in_order(tmp_path):
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "a photo of a dog", "seed": 7, "negative_prompt": "cat"}\n\n'
                    '{"prompt": "a photo of a cat", "name": "cat"}\n')
    first, dog, cat = load_prompts(Validation(prompts=["a red dog"], prompt_file=str(file), seed=3), (64, 64))
    assert (first.prompt, first.seed) == ("a red dog", 3)
    assert (dog.prompt, dog.seed, dog.negative_prompt) == ("a photo of a dog", 7, "cat")
    assert (cat.name, cat.seed) == ("cat", 5)


def test_the_same_prompt_twice_gets_two_names(tmp_path):
    a, b = load_prompts(Validation(prompts=["a dog", "a dog"]), (64, 64))
    assert a.name != b.name


@pytest.mark.parametrize(("text", "suffix", "problem"), [
    ("a red dog --ss euler_a\n", ".txt", "line 1: --ss is not an option"),
    ("--n blurry\n", ".txt", "has options but no prompt"),
    ("a dog --d seven\n", ".txt", "seed must be int"),
    ('{"prompt": "a dog", "sampler": "euler"}\n', ".jsonl", "unknown field 'sampler'"),
    ("not json\n", ".jsonl", "line 1 is not JSON"),
    ("[1, 2]", ".json", "expected an object"),
    ("# only a comment\n", ".txt", "holds no prompt"),
])
def test_a_bad_prompt_file_names_the_line_and_the_fix(tmp_path, text, suffix, problem):
    file = tmp_path / f"prompts{suffix}"
    file.write_text(text)
    with pytest.raises(ConfigError) as err:
        prompts_of(file)
    assert err.value.key == "validation.prompt_file" and problem in str(err.value) and err.value.fix


def test_the_weights_to_sample():
    assert weights_to_sample(compose_cfg()) == ("model",)
    assert weights_to_sample(compose_cfg("ema.enabled=true")) == ("ema",)
    assert weights_to_sample(compose_cfg("ema.enabled=true", "ema.use_for_samples=false")) == ("model",)
    assert weights_to_sample(compose_cfg("ema.enabled=true", "validation.weights=comparison")) == ("model", "ema")


def test_no_prompts_means_no_validation_and_no_check():
    assert check_validation(compose_cfg("validation.every_n_steps=-5")) == []


# --- refused before training, with fixes that work ---------------------------------------------------------------

@pytest.fixture(scope="module")
def text_run(tmp_path_factory, tiny_sdxl_components):
    """The overrides of a text model's run on a captioned folder (nothing is trained)."""
    folder = make_folder(tmp_path_factory.mktemp("validation_images"))
    return ["model=sdxl_tiny", "data=folder", f"data.path={folder}", f"model.components={tiny_sdxl_components}",
            "resolution.size=64", "train.batch_size=2"]


def test_prompts_for_the_class_model_are_plan_error():
    err = plan_error('validation.prompts=["a dog"]')
    assert err.key == "validation.prompts" and "class-conditional" in err.problem


@pytest.mark.parametrize(("override", "key"), [
    ("validation.every_n_steps=-1", "validation.every_n_steps"),
    ("validation.steps=0", "validation.steps"),
    ("validation.guidance_scale=-2", "validation.guidance_scale"),
    ("validation.guidance_rescale=3", "validation.guidance_rescale"),
    ("validation.weights=best", "validation.weights"),
    ("validation.weights=ema", "validation.weights"),
    ("validation.resolution=70", "validation.resolution"),
    ("validation.resolution=[64,64,3]", "validation.resolution"),
    ("validation.prompt_file=/nonexistent/prompts.txt", "validation.prompt_file"),
])
def test_a_bad_setting_is_refused_with_a_fix_that_works(text_run, override, key):
    err = plan_error(*text_run, 'validation.prompts=["a red dog"]', override)
    assert err.key == key


def test_a_text_model_without_components_is_plan_error():
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg("model=sdxl_tiny", "data=synthetic", "resolution.size=64",
                              'validation.prompts=["a dog"]'))
    assert err.value.key == "model.components" and "/path/to/" in err.value.fix


def test_a_good_block_passes(text_run, tmp_path):
    file = tmp_path / "p.txt"
    file.write_text("a red dog --w 128 --h 64\n")
    run = preflight(compose_cfg(*text_run, f"validation.prompt_file={file}", "validation.every_n_steps=100"))
    assert run.config.validation.every_n_steps == 100


def test_a_prompt_file_gone_after_the_checks_turns_validation_off_unless_strict(text_run, tmp_path):
    """Between preflight and the workers' start the file went away: recorded, and the run trains on."""
    import torch

    from zerotune.rundir import RunDir
    from zerotune.train.validation import make_validator

    file = tmp_path / "gone.txt"

    def made(cfg):
        return make_validator(cfg, RunDir(tmp_path / "run"), NullLogger(), torch.device("cpu"), torch.float32, 0, 1)

    for strict in (False, True):
        cfg = compose_cfg(*text_run, f"validation.prompt_file={file}", f"validation.strict={strict}")
        if strict:
            with pytest.raises(ConfigError) as err:
                made(cfg)
            assert err.value.key == "validation.prompt_file"
        else:
            validator, error = made(cfg)
            assert validator is None and error["key"] == "validation.prompt_file" and "gone.txt" in error["message"]

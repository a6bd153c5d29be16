"""data=folder's caption rules: tags shuffled behind the first keep_tags into cached variants, and caption dropout
to the empty caption's cached entry; the same seed draws the same captions in the same order; the cache's size in
the data report; trained end to end at ZeRO-2 and ZeRO-3 (with a trained text encoder reading the tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cli import compose_cfg, read_summary, run_cli
from tests.helpers.fixes import refused_with_fixes
from tests.helpers.folder_fixtures import noise_images
from zerotune.config.schema import Data
from zerotune.data import build_loader
from zerotune.data.buckets import BucketBatchSampler, Ref
from zerotune.data.captions import CaptionRules
from zerotune.data.components import FrozenEncoders
from zerotune.data.prepare import prepare_folder_data
from zerotune.data.spec import DataSpec

CAPTIONS = ("dog, red, grass, sunny, photo", "cat, blue, sofa, night, photo", "dog, blue, snow, photo",
            "cat, red, grass, photo")


@pytest.fixture(scope="module")
def tagged(tmp_path_factory) -> Path:
    """8 random 64x64 images with comma-separated tag captions."""
    return noise_images(tmp_path_factory.mktemp("tagged"), CAPTIONS, seed=1)


def _overrides(tagged: Path, components: Path, cache: Path, *extra: str) -> list[str]:
    return ["model=sdxl_tiny", "data=folder", f"data.path={tagged}", f"model.components={components}",
            "resolution.size=64", "train.batch_size=2", f"data.cache_dir={cache}", *extra]


def _spec(*overrides: str) -> DataSpec:
    return DataSpec.from_config(compose_cfg(*overrides))


def test_shuffles_keep_the_first_tags_and_are_the_same_in_every_run():
    rules = CaptionRules.of(Data(name="folder", shuffle_tags=True, keep_tags=1, caption_variants=6))
    texts = rules.texts(CAPTIONS[0])
    assert len(texts) == 6 and len(set(texts)) > 1 and texts == rules.texts(CAPTIONS[0])
    for text in texts:
        tags = text.split(", ")
        assert tags[0] == "dog" and sorted(tags[1:]) == sorted(["red", "grass", "sunny", "photo"])
    assert CaptionRules.of(Data(name="folder")).texts(CAPTIONS[0]) == (CAPTIONS[0],)  # off: the caption itself
    pipe = CaptionRules.of(Data(name="folder", shuffle_tags=True, tag_separator="|", caption_variants=2))
    assert all(sorted(t.split("| ")) == ["a", "b", "c"] for t in pipe.texts("a|b|c"))


def test_the_sampler_draws_variants_and_drops_from_the_seed():
    buckets = [(64, 64)] * 16

    def epoch(seed: int) -> list[Ref]:
        return [r for batch in BucketBatchSampler(buckets, 4, seed, caption_variants=4, caption_dropout=0.25)
                for r in batch]

    first = epoch(0)
    assert first == epoch(0) and first != epoch(1)
    assert {r.variant for r in first} == {0, 1, 2, 3} and any(r.dropped for r in first)
    assert sorted(r.sample for r in first) == list(range(16))
    plain = [r for b in BucketBatchSampler(buckets, 4, 0) for r in b]
    assert plain == [r.sample for r in first]  # the caption rules' draws come after: the order is the plain one


def test_variants_and_the_empty_caption_are_cached_and_counted(tagged, tiny_sdxl_components, tmp_path):
    plain_spec = _spec(*_overrides(tagged, tiny_sdxl_components, tmp_path / "plain"))
    _, plain = prepare_folder_data(plain_spec, progress=False)
    spec = _spec(*_overrides(tagged, tiny_sdxl_components, tmp_path / "cache", "data.shuffle_tags=true",
                             "data.keep_tags=1", "data.caption_variants=4", "data.caption_dropout=0.1"))
    dataset, report = prepare_folder_data(spec, progress=False)
    rules = report["caption_rules"]
    distinct = {t for c in CAPTIONS for t in CaptionRules.of(spec.data).texts(c)}
    assert rules["variants_per_caption"] == 4 and rules["text_entries"] == len(distinct) + 1  # + the empty caption
    assert report["cache"]["texts_computed"] == len(distinct) + 1
    assert report["cache_mib"]["text"] == pytest.approx(plain["cache_mib"]["text"] * (len(distinct) + 1)
                                                        / len(CAPTIONS), rel=0.02)
    encoders = FrozenEncoders(_components(spec), torch.device("cpu"), spec.model)
    item = dataset.items[0]
    for variant in (0, 3):
        hidden, _ = encoders.encode_text([item.texts[variant]])
        torch.testing.assert_close(dataset[Ref(0, variant=variant)]["encoder_hidden_states"], hidden[0])
    empty, _ = encoders.encode_text([""])
    torch.testing.assert_close(dataset[Ref(0, variant=2, dropped=True)]["encoder_hidden_states"], empty[0])


def _components(spec: DataSpec):
    from zerotune.data.components import resolve_components

    return resolve_components(spec.model)


def test_two_loaders_with_the_same_seed_see_the_same_captions_in_the_same_order(tagged, tiny_sdxl_components,
                                                                                tmp_path):
    overrides = _overrides(tagged, tiny_sdxl_components, tmp_path / "cache", "data.shuffle_tags=true",
                           "data.caption_dropout=0.2")

    def states(seed: int) -> list[torch.Tensor]:
        loader = build_loader(_spec(*overrides), 2, seed)
        return [b["encoder_hidden_states"] for _ in range(3) for b in loader]  # three epochs

    first = states(0)
    assert all(torch.equal(a, b) for a, b in zip(first, states(0), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, states(1), strict=True))


@pytest.mark.parametrize("stage,extra", [("2", ()), ("3", ("model.train_text_encoder=te1",))])
def test_caption_rules_train_end_to_end(stage, extra, tagged, tiny_sdxl_components, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*_overrides(tagged, tiny_sdxl_components, tmp_path / "cache", "data.shuffle_tags=true",
                               "data.keep_tags=1", "data.caption_dropout=0.25", *extra),
                   f"zero_stage={stage}", "train.max_steps=3", f"hydra.run.dir={run}", env={"OMP_NUM_THREADS": "1"},
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "ok"
    assert summary["data"]["caption_rules"]["variants_per_caption"] == 4  # the default with shuffle_tags


@pytest.mark.parametrize("overrides,key", [
    (["data=synthetic", "model=sdxl_tiny", "data.shuffle_tags=true"], "data.shuffle_tags"),
    (["data=synthetic", "model=sdxl_tiny", "data.caption_dropout=1.5"], "data.caption_dropout"),
    (["data=synthetic", "model=sdxl_tiny", "data.caption_variants=4"], "data.caption_variants"),
])
def test_bad_caption_settings_are_refused_with_a_fix(overrides, key, tmp_path):
    err, fixes = refused_with_fixes(overrides, tmp_path)
    assert err.key == key, err
    assert fixes >= 1

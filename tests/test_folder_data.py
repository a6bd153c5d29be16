"""data=folder: scanning, buckets, the batch sampler, the latent cache, bad input, and one CLI run."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.helpers.cli import compose_cfg, read_summary, run_cli
from tests.helpers.folder_fixtures import (
    CAPTIONS,
    EXPECTED_BUCKET,
    MISSING_CAPTIONS,
    REPEATS,
    SAMPLES,
    USED,
    make_folder,
)
from tests.helpers.tiny_components import save_vae
from zerotune.config.errors import ConfigError
from zerotune.data import build_loader, check_data
from zerotune.data.buckets import BucketBatchSampler, closest_bucket, make_buckets, place
from zerotune.data.components import FrozenEncoders
from zerotune.data.prepare import prepare_folder_data
from zerotune.data.sources import crop_pixels, open_rgb, scan_folder
from zerotune.data.spec import DataSpec


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """On a shared 2-core machine, OpenMP threads spinning against other jobs make these tiny models many
    times slower; one thread keeps the module's run time steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def folder(tmp_path):
    return make_folder(tmp_path / "images")


@pytest.fixture
def calls(monkeypatch):
    """How often each encoder runs and loads, through the real FrozenEncoders."""
    counts = Counter()

    def counting(name):
        original = getattr(FrozenEncoders, name)

        def wrapper(self, *args):
            counts[name] += len(args[0]) if name.startswith("encode") else 1
            return original(self, *args)
        return wrapper

    for name in ("encode_images", "encode_text", "_load_vae", "_load_text"):
        monkeypatch.setattr(FrozenEncoders, name, counting(name))
    return counts


def folder_cfg(folder, components, tmp_path, *extra) -> DataSpec:
    return DataSpec.from_config(compose_cfg(
        "model=sdxl_tiny", "data=folder", f"data.path={folder}", f"model.components={components}",
        "resolution.size=128", "train.batch_size=2", f"data.cache_dir={tmp_path / 'cache'}", *extra))


def test_tiny_tokenizer_works_offline(tiny_sdxl_components, monkeypatch):
    from transformers import CLIPTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = CLIPTokenizer.from_pretrained(tiny_sdxl_components / "tokenizer", local_files_only=True)
    ids = tok("a red dog", padding="max_length", max_length=77).input_ids
    assert tok.convert_ids_to_tokens(ids[:5]) == ["<|startoftext|>", "a</w>", "red</w>", "dog</w>", "<|endoftext|>"]
    assert len(ids) == 77


# --- buckets -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [128, 512, 1024])
def test_buckets_sdxl_style(size):
    buckets = make_buckets(size)
    assert (size, size) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0 and w * h <= size * size and max(w, h) / min(w, h) <= 4
        assert (h, w) in buckets
        assert w * (h + 64) > size * size or (w + 64) * h > size * size  # no side can grow
    if size == 1024:  # SDXL's training buckets
        assert {(1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344),
                (1536, 640), (640, 1536), (2048, 512), (512, 2048)} <= set(buckets)


@pytest.mark.parametrize(("w", "h"), [(300, 150), (150, 300), (1000, 1000), (4000, 900), (640, 480), (3, 17)])
def test_image_goes_to_bucket_closest_in_aspect_ratio(w, h):
    buckets = make_buckets(1024)
    chosen = closest_bucket(w, h, buckets)
    distance = [abs(math.log(b[0] / b[1]) - math.log(w / h)) for b in buckets]
    assert abs(math.log(chosen[0] / chosen[1]) - math.log(w / h)) == pytest.approx(min(distance))


def test_placement_covers_bucket_and_time_ids_record_it():
    p = place(301, 100, (192, 64))  # scaled by 0.64: 193x64, one spare column
    assert (p.resized_w, p.resized_h, p.crop_left, p.crop_top) == (193, 64, 0, 0)
    assert p.time_ids() == [100, 301, 0, 0, 64, 192]
    assert p.time_ids(flipped=True) == [100, 301, 0, 1, 64, 192]  # crop_left mirrored
    p = place(300, 200, (128, 128))
    assert (p.resized_w, p.resized_h, p.crop_left, p.crop_top) == (192, 128, 32, 0) and not p.upscales
    assert place(40, 40, (128, 128)).upscales


def test_flipped_crop_is_the_mirrored_crop_of_the_flipped_image():
    """What random_flip caches (mirrored crop pixels) is what time_ids' mirrored crop_left describes."""
    img = Image.effect_noise((301, 100), 64).convert("RGB")
    p = place(301, 100, (192, 64))
    mirrored = ImageOps.mirror(img.resize((p.resized_w, p.resized_h), Image.Resampling.LANCZOS))
    left, top = p.mirrored_crop_left(), p.crop_top
    crop = torch.from_numpy(np.array(mirrored.crop((left, top, left + 192, top + 64)))).permute(2, 0, 1)
    assert torch.equal(crop_pixels(img, p).flip(-1), crop.float() / 127.5 - 1.0)


# --- scanning ------------------------------------------------------------------------------------------

def test_scan_finds_images_captions_and_problems(folder):
    scan = scan_folder(folder, {"dogs": 2, "dogs/puppies": 3})
    by_name = {r.rel: r for r in scan.records}
    assert sorted(by_name) == sorted([*USED, "tiny.png", "truncated.jpg"])  # decoded later, not here
    assert [s.rel for s in scan.skipped] == ["broken.png"] and "unreadable" in scan.skipped[0].reason
    assert by_name["dogs/d2.png"].caption == "sidecar wins" and by_name["dogs/d2.png"].caption_source == "sidecar"
    assert by_name["dogs/d1.png"].caption == "a dog" and by_name["dogs/puppies/p1.png"].caption == "a puppy"
    assert by_name["sq_c.webp"].caption == "" and by_name["sq_c.webp"].caption_source == "missing"
    assert (by_name["rot.jpg"].width, by_name["rot.jpg"].height) == (100, 200)  # EXIF rotation applied
    assert open_rgb(folder / "rot.jpg").size == (100, 200)
    assert [by_name[n].repeats for n in ("sq_a.png", "dogs/d1.png", "dogs/puppies/p1.png")] == [1, 2, 3]
    assert len(scan.problems) == 2  # a line that is not JSON, an entry without its file
    assert scan.other_files == 1             # notes.md; .hidden/ is not searched


# --- sampler -------------------------------------------------------------------------------------------

def test_batches_never_mix_buckets_and_are_seeded():
    buckets = [(64, 256)] * 7 + [(128, 128)] * 10 + [(256, 64)] * 5 + [(64, 192)] * 1
    sampler = BucketBatchSampler(buckets, batch_size=2, seed=3)
    epoch0 = list(sampler)
    epoch1 = list(sampler)
    assert len(epoch0) == len(sampler) == 3 + 5 + 2  # incomplete batches dropped; the lone 64x192 never
    for batch in epoch0 + epoch1:
        assert len(batch) == 2 and len({buckets[i] for i in batch}) == 1
    for epoch in (epoch0, epoch1):
        seen = [i for b in epoch for i in b]
        assert len(seen) == len(set(seen))  # each sample at most once per epoch
    assert epoch0 != epoch1  # reshuffled every epoch
    sampler.set_epoch(0)
    assert list(sampler) == epoch0 and list(BucketBatchSampler(buckets, 2, seed=3)) == epoch0
    assert list(BucketBatchSampler(buckets, 2, seed=4)) != epoch0
    order = [buckets[b[0]] for b in epoch0]
    assert any(order[i] != order[i + 1] and order[i] in order[i + 2:] for i in range(len(order) - 2))  # interleaved


def test_flip_sampler_yields_index_and_coin():
    sampler = BucketBatchSampler([(64, 64)] * 64, batch_size=8, seed=0, random_flip=True)
    refs = [r for batch in sampler for r in batch]
    assert all(isinstance(i, int) and isinstance(f, bool) for i, f in refs)
    assert 16 < sum(f for _, f in refs) < 48


# --- prepare: report, cache, bad input --------------------------------------------------------------------

def test_prepare_reports_every_image(folder, tiny_sdxl_components, tmp_path, calls):
    cfg = folder_cfg(folder, tiny_sdxl_components, tmp_path, REPEATS)
    dataset, report = prepare_folder_data(cfg, tmp_path / "run", progress=False)
    full = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["images_found"] == 14 and report["images_used"] == len(USED) == 11
    assert report["skipped"] == {"unreadable": 2, "too_small": 1}
    assert report["captions"] == {"sidecar": 7, "metadata": 2, "missing": 2}
    assert report["samples_per_epoch"] == len(dataset) == SAMPLES
    assert report["buckets"]["128x128"] == {"samples": 10, "batches_per_epoch": 5, "left_out_per_epoch": 0}
    assert report["buckets"]["64x256"]["batches_per_epoch"] == 0  # one image: never in a batch, and said so
    reasons = {s["file"]: s["reason"] for s in full["skipped_files"]}
    assert set(reasons) == {"broken.png", "truncated.jpg", "tiny.png"}
    assert "corrupt" in reasons["truncated.jpg"] and "upscale_small" in reasons["tiny.png"]
    assert full["missing_captions"] == MISSING_CAPTIONS and len(full["problem_list"]) == 2 and report["problems"] == 2
    assert "skipped_files" not in report and report["report_file"].endswith("data_report.json")
    assert calls["encode_images"] == 11 and calls["encode_text"] == CAPTIONS  # truncated.jpg never encoded
    assert {it.record.rel: it.placement.bucket for it in dataset.items} == EXPECTED_BUCKET
    item = dataset[0]
    w, h = dataset.items[0].placement.bucket
    assert item["x0"].shape == (4, h // 4, w // 4)
    assert item["encoder_hidden_states"].shape == (77, 96) and item["text_embeds"].shape == (64,)
    assert item["time_ids"].tolist() == dataset.items[0].placement.time_ids()


def test_latents_are_the_scaled_vae_mean(folder, tiny_sdxl_components, tmp_path):
    from diffusers import AutoencoderKL

    dataset, _ = prepare_folder_data(folder_cfg(folder, tiny_sdxl_components, tmp_path), progress=False)
    item = next(it for it in dataset.items if it.record.rel == "wide_a.png")
    vae = AutoencoderKL.from_pretrained(tiny_sdxl_components / "vae", local_files_only=True)
    with torch.no_grad():
        mean = vae.encode(crop_pixels(open_rgb(item.record.path), item.placement)[None]).latent_dist.mean[0]
    cached = dataset[dataset.items.index(item)]["x0"]
    assert torch.allclose(cached, mean * vae.config.scaling_factor, atol=1e-5)


def test_second_run_computes_and_loads_nothing(folder, tiny_sdxl_components, tmp_path, calls):
    cfg = folder_cfg(folder, tiny_sdxl_components, tmp_path)
    _, first = prepare_folder_data(cfg, progress=False)
    calls.clear()
    dataset, second = prepare_folder_data(cfg, progress=False)
    assert not calls  # no encoder loaded, none called
    assert second["cache"]["latents_computed"] == second["cache"]["texts_computed"] == 0
    assert second["cache"]["latents_reused"] == first["cache"]["latents_computed"] == 11
    assert second["cache"]["texts_reused"] == CAPTIONS
    assert len(dataset) == 11 and second["skipped"]["unreadable"] == 2  # the corrupt file is retried, reported


def test_one_changed_caption_recomputes_one_text_entry(folder, tiny_sdxl_components, tmp_path, calls):
    cfg = folder_cfg(folder, tiny_sdxl_components, tmp_path)
    prepare_folder_data(cfg, progress=False)
    calls.clear()
    (folder / "sq_a.txt").write_text("a green dog")
    _, report = prepare_folder_data(cfg, progress=False)
    assert dict(calls) == {"_load_text": 1, "encode_text": 1}
    assert report["cache"]["texts_computed"] == 1 and report["cache"]["latents_computed"] == 0


def test_another_vae_recomputes_every_latent_and_no_text(folder, tiny_sdxl_components, tmp_path, calls):
    prepare_folder_data(folder_cfg(folder, tiny_sdxl_components, tmp_path), progress=False)
    calls.clear()
    save_vae(tmp_path / "vae_b", seed=1)  # same architecture, other weights
    cfg = folder_cfg(folder, tiny_sdxl_components, tmp_path, f"model.vae={tmp_path / 'vae_b'}")
    _, report = prepare_folder_data(cfg, progress=False)
    assert report["cache"]["latents_computed"] == 11 and report["cache"]["latents_reused"] == 0
    assert report["cache"]["texts_computed"] == 0 and "_load_text" not in calls


def test_random_flip_caches_mirrored_views(folder, tiny_sdxl_components, tmp_path, calls):
    prepare_folder_data(folder_cfg(folder, tiny_sdxl_components, tmp_path), progress=False)
    cfg = folder_cfg(folder, tiny_sdxl_components, tmp_path, "data.random_flip=true")
    dataset, report = prepare_folder_data(cfg, progress=False)
    assert report["cache"]["latents_computed"] == 11 and report["cache"]["latents_reused"] == 11
    i = next(i for i, it in enumerate(dataset.items) if it.record.rel == "wide_b.png")
    plain, flipped = dataset[i], dataset[(i, True)]
    assert flipped["time_ids"].tolist() == dataset.items[i].placement.time_ids(flipped=True)
    assert not torch.allclose(plain["x0"], flipped["x0"])
    encoders = FrozenEncoders(cfg_paths(tiny_sdxl_components), torch.device("cpu"), cfg.model)
    pixels = crop_pixels(open_rgb(dataset.items[i].record.path), dataset.items[i].placement)
    assert torch.allclose(flipped["x0"], encoders.encode_images(pixels.flip(-1)[None])[0], atol=1e-5)
    batch = next(iter(build_loader(cfg, 2, seed=0)))
    assert batch["x0"].shape[0] == 2


def cfg_paths(components):
    from zerotune.data.components import resolve_components

    return resolve_components(compose_cfg("model=sdxl_tiny", f"model.components={components}").model)


def test_upscale_small_keeps_and_counts_small_images(folder, tiny_sdxl_components, tmp_path):
    _, report = prepare_folder_data(folder_cfg(folder, tiny_sdxl_components, tmp_path, "data.upscale_small=true"),
                                    progress=False)
    assert report["skipped"] == {"unreadable": 2, "too_small": 0} and report["upscaled"] == 1
    assert report["images_used"] == 12


def test_build_loader_gives_bucket_batches(folder, tiny_sdxl_components, tmp_path):
    loader = build_loader(folder_cfg(folder, tiny_sdxl_components, tmp_path, REPEATS), 2, seed=0, run_dir=tmp_path / "r")
    assert isinstance(loader.batch_sampler, BucketBatchSampler) and (tmp_path / "r/data_report.json").is_file()
    shapes = Counter(tuple(b["x0"].shape) for b in loader)
    assert shapes == {(2, 4, 32, 32): 5, (2, 4, 16, 64): 1, (2, 4, 48, 16): 1}
    assert loader.dataset.report["images_used"] == 11


# --- bad input: a ConfigError naming the key, before any model loads ----------------------------------------

def fails_with(key, cfg, calls, run=prepare_folder_data):
    spec = cfg if isinstance(cfg, DataSpec) else DataSpec.from_config(cfg)
    with pytest.raises(ConfigError) as err:
        run(spec)
    assert err.value.key == key, str(err.value)
    assert not calls, "no model may load before a data error"
    return err.value


def test_empty_folder(tmp_path, calls):
    (tmp_path / "empty").mkdir()
    # No tiny_sdxl_components either: the folder is checked first.
    cfg = compose_cfg("model=sdxl_tiny", "data=folder", f"data.path={tmp_path / 'empty'}", "resolution.size=128")
    err = fails_with("data.path", cfg, calls, check_data)
    assert "no usable image" in err.problem and "metadata.jsonl" in err.fix
    fails_with("data.path", cfg, calls)


def test_only_corrupt_or_small_images(tmp_path, tiny_sdxl_components, calls):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.png").write_bytes(b"garbage")
    fails_with("data.path", folder_cfg(bad, tiny_sdxl_components, tmp_path), calls)
    Image.new("RGB", (30, 30)).save(bad / "small.png")
    assert "upscale_small" in fails_with("data.path", folder_cfg(bad, tiny_sdxl_components, tmp_path), calls).fix
    # Headers fine, pixels not: found while caching (the VAE never loads: no image decoded).
    (bad / "small.png").unlink()
    (bad / "cut.jpg").write_bytes((make_folder(tmp_path / "src") / "truncated.jpg").read_bytes())
    fails_with("data.path", folder_cfg(bad, tiny_sdxl_components, tmp_path, "train.batch_size=1"), calls)


@pytest.mark.parametrize(("overrides", "key"), [
    (["data.path=null"], "data.path"),
    (["model.components=null"], "model.vae"),
    (["data.repeats={cats:2}"], "data.repeats.cats"),
    (["data.repeats={dogs:0}"], "data.repeats.dogs"),
    (["model.vae_scale_factor=8"], "model.vae"),
    (["model.unet.cross_attention_dim=128"], "model.text_encoder"),
    (["data.bucket_step=72"], "data.bucket_step"),
    (["train.batch_size=11"], "train.batch_size"),
])
def test_config_errors_name_the_key(folder, tiny_sdxl_components, tmp_path, calls, overrides, key):
    err = fails_with(key, folder_cfg(folder, tiny_sdxl_components, tmp_path, *overrides), calls, check_data)
    assert err.fix


def test_folder_needs_a_text_time_model(folder, calls):
    cfg = compose_cfg("model=tiny", "data=folder", f"data.path={folder}")
    assert "model=sdxl" in fails_with("data", cfg, calls, check_data).fix


# --- end to end ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_folder_training_through_the_cli(folder, tiny_sdxl_components, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as one_thread does in-process
    run_dir = tmp_path / "run"
    proc = run_cli("model=sdxl_tiny", "data=folder", f"data.path={folder}", f"model.components={tiny_sdxl_components}",
                   "resolution.size=64", "train.max_steps=3", "train.batch_size=2", "evaluate.enabled=false",
                   f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    assert summary["steps"] == 3 and summary["choices"]["data"] == "folder"
    assert math.isfinite(summary["loss_last"])
    assert len(list((tmp_path / "cache" / "latents").rglob("*.safetensors"))) == 11  # all at 64x64

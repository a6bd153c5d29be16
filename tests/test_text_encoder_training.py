"""model.train_text_encoder: the text encoders trained with the U-Net in one engine, full or with LoRA, each with its
own learning rate; resumed bit-identically at ZeRO-2 and ZeRO-3; exported as diffusers pipelines load them; and
refused, with a fix that works, where the model or the data has no text encoder to train."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.cli import compose_cfg, config_of, preflight, read_summary, run_cli
from tests.helpers.folder_fixtures import make_folder
from tests.helpers.pipelines import draw, pipeline
from zerotune.config.errors import ConfigError

# Published text encoders: CLIP ViT-L/14's text model (SDXL's text_encoder, SD 1.5's) and OpenCLIP ViT-bigG/14's
# with its projection (SDXL's text_encoder_2): the parameter counts of their model.safetensors.
TE1, TE2 = 123_060_480, 694_659_840
SDXL_UNET = 2_567_463_684


@pytest.mark.parametrize(("choice", "extra"), [("te1", TE1), ("both", TE1 + TE2)])
def test_the_trained_encoders_are_counted_as_the_engine_holds_them(choice, extra):
    from zerotune.models import model_stats

    stats = model_stats(compose_cfg("model=sdxl", f"model.train_text_encoder={choice}").model)
    assert stats.num_params == stats.num_trainable == SDXL_UNET + extra


def test_lora_on_the_encoders_trains_their_adapters_only():
    from zerotune.models import model_stats

    cfg = config_of("model=sd15", "model.train_text_encoder=te1", "adapter=lora")
    unet_only = model_stats(config_of("model=sd15", "adapter=lora").model, cfg.adapter)
    stats = model_stats(cfg.model, cfg.adapter)
    # rank 16 on q, k, v and out of CLIP-L's 12 layers: 4 projections x (768 x 16 + 16 x 768) x 12
    assert stats.num_trainable - unet_only.num_trainable == 4 * 2 * 768 * 16 * 12
    assert stats.num_params - stats.num_trainable == 859_520_964 + TE1


@pytest.mark.parametrize(("overrides", "key", "fix"), [
    (("model=sd15", "model.train_text_encoder=te2"), "model.train_text_encoder", "model.train_text_encoder=te1"),
    (("model=tiny", "model.train_text_encoder=te1"), "model.train_text_encoder", "model.train_text_encoder=none"),
    (("model=sdxl", "model.train_text_encoder=all"), "model.train_text_encoder", "model.train_text_encoder=both"),
    (("model=sdxl", "model.train_text_encoder=te1", "model.text_encoder_lr=-1"), "model.text_encoder_lr",
     "model.text_encoder_lr=1e-6"),
])
def test_an_impossible_choice_is_refused_with_a_fix_that_works(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg(*overrides, "resolution=1024", "data=synthetic"))
    assert err.value.key == key and fix in err.value.fix
    applied = [o for o in overrides if not o.startswith(key + "=")] + [fix]
    assert preflight(compose_cfg(*applied, "resolution=1024", "data=synthetic")).config.model.name


def test_data_without_captions_is_refused_for_a_job_that_trains(tmp_path):
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg("model=sd15_tiny", "resolution=64", "data=synthetic", "model.train_text_encoder=te1"),
                  run_dir=tmp_path)
    assert err.value.key == "model.train_text_encoder" and "data=folder" in err.value.fix
    # a plan of it (no run dir) plans the synthetic shapes
    plan = preflight(compose_cfg("model=sd15_tiny", "resolution=64", "data=synthetic", "model.train_text_encoder=te1"))
    assert plan.model_stats.num_trainable > plan.model_stats.num_params - plan.model_stats.num_trainable


def test_each_encoder_gets_its_own_learning_rate_through_the_scheduler():
    """DeepSpeed's WarmupLR sets every group to its warmup_max_lr: one entry per group (U-Net, te1, te2)."""
    run = preflight(compose_cfg("model=sdxl", "resolution=1024", "data=synthetic", "model.train_text_encoder=both",
                                "model.text_encoder_lr=2e-6", "optimizer.lr=1e-5", "scheduler=warmup"))
    assert run.ds_config["scheduler"]["params"]["warmup_max_lr"] == [1e-5, 2e-6, 1e-5]
    from deepspeed.runtime.lr_schedules import WarmupLR

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, [1e-5, 2e-6, 1e-5], strict=True)])
    sched = WarmupLR(opt, **run.ds_config["scheduler"]["params"])
    for _ in range(200):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-5, 2e-6, 1e-5])


def test_the_plan_counts_the_trained_encoder_in_every_term():
    """`zerotune plan model=sd15 model.train_text_encoder=te1 ...`: CLIP-L's weights, gradients and 8-bit states
    beside the U-Net's, its forward and backward in the step's trace; the workload line says so."""
    from zerotune.plan import predict
    from zerotune.plan.gpus import lookup

    def plan(choice: str) -> dict:
        checked = preflight(compose_cfg("model=sd15", "resolution=512", "precision=bf16", "train.batch_size=1",
                                        "zero_stage=2", "optimizer=adamw8bit", "train.gradient_checkpointing=true",
                                        f"model.train_text_encoder={choice}"))
        return predict.predict(checked, lookup("rtx4090"))

    alone, both = plan("none"), plan("te1")
    terms = {name: {t.term: t for t in p.gpu_terms} for name, p in (("alone", alone), ("both", both))}
    assert "text encoders trained with the U-Net: text_encoder" in both.workload
    assert terms["both"]["params"].mib - terms["alone"]["params"].mib == pytest.approx(TE1 * 2 / 2**20, abs=0.1)
    assert terms["both"]["activations"].mib > terms["alone"]["activations"].mib
    assert "Optimizer2State.init_state" in terms["both"]["optimizer_states"].note
    assert terms["both"]["optimizer_states"].mib > terms["alone"]["optimizer_states"].mib


def test_resuming_another_choice_is_refused(tmp_path):
    from zerotune.rundir.resume import current_meta, decide_resume

    cfg = compose_cfg("model=sdxl_tiny", "model.train_text_encoder=te1", "resolution.size=64", "data=synthetic")
    run = preflight(cfg)
    meta = current_meta(cfg, run.ds_config, run.use_deepspeed, 1)
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "train_text_encoder": "both", "step": 2}))
    with pytest.raises(ConfigError) as err:
        decide_resume(tmp_path, meta, dict(run.ds_config))
    assert err.value.key == "model.train_text_encoder" and "model.train_text_encoder=both" in err.value.fix


# --- end to end: train, resume, export ---------------------------------------------------------------------

CASES = {
    "sdxl-both-lora-zero3": ("sdxl", "both", "lora", 3),
    "sd15-te1-full-zero2": ("sd15", "te1", "none", 2),
    "sdxl-both-full-zero2": ("sdxl", "both", "none", 2),
    "sdxl-te1-lora-zero2": ("sdxl", "te1", "lora", 2),
    "sd15-te1-lora-zero3": ("sd15", "te1", "lora", 3),
    "sd15-te1-full-zero3": ("sd15", "te1", "none", 3),
    "sdxl-both-full-zero3": ("sdxl", "both", "none", 3),
    "sd15-te1-lora-zero2": ("sd15", "te1", "lora", 2),
}
FAST = ("sdxl-both-lora-zero3",)  # the rest: -m slow


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from tests.helpers.tiny_components import save_tiny_pipeline, save_tiny_sd15_pipeline

    root = tmp_path_factory.mktemp("te_parts")
    return {"sdxl": save_tiny_pipeline(root / "sdxl"), "sd15": save_tiny_sd15_pipeline(root / "sd15"),
            "images": make_folder(root / "images")}


def _train(parts: dict, case: str, run_dir: Path, *extra: str) -> Path:
    model, choice, adapter, stage = CASES[case]
    proc = run_cli(f"model={model}_tiny", "data=folder", f"data.path={parts['images']}",
                   f"model.components={parts[model]}", f"data.cache_dir={parts['images'].parent / 'cache'}",
                   "resolution.size=64", "train.batch_size=2", "train.max_steps=4", "checkpoint.every_n_steps=2",
                   "scheduler=constant", "optimizer.lr=1e-3", "model.text_encoder_lr=5e-4",
                   f"model.train_text_encoder={choice}", f"adapter={adapter}", f"zero_stage={stage}",
                   f"hydra.run.dir={run_dir}", *extra, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from zerotune.rundir.checkpoint_io import full_state

    weights, _, _ = full_state(checkpoint, with_optimizer=False)
    return weights


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_trained_resumed_and_exported(case, parts, tmp_path):
    from safetensors.torch import load_file

    model, choice, adapter, _ = CASES[case]
    straight = _train(parts, case, tmp_path / "straight")
    summary = read_summary(straight)
    assert summary["status"] == "ok" and summary["data"]["text_conditioning"]["text_encoder"] == "tokens (trained)"
    # the planner's model states are the engine's, one flat partition per parameter group (U-Net, each encoder)
    from zerotune.plan.model_states import Partitioning
    from zerotune.plan.resolve import ResolvedRun, resolved_file

    run = ResolvedRun.from_json(json.loads((straight / resolved_file(0)).read_text()))
    stats = run.model_stats
    planned = Partitioning(list(stats.param_numels), run.ds_config, 1, True, list(stats.trainable_numels),
                           run.group_sizes(), run.client_optimizer).states
    assert len(stats.trainable_groups) == 1 + {"te1": 1, "both": 2}[choice]
    assert {k: planned[k] for k in summary["partition"] if k.endswith("_bytes")} == \
        {k: v for k, v in summary["partition"].items() if k.endswith("_bytes")}
    resumed = _train(parts, case, tmp_path / "resumed", f"resume={straight / 'checkpoints/step-0000002'}")
    assert read_summary(resumed)["steps"] == 4
    final, again = _weights(straight / "checkpoints/step-0000004"), _weights(resumed / "checkpoints/step-0000004")
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)  # bit-identical

    # what trained changed; what was frozen did not
    original = load_file(str(parts[model] / "text_encoder/model.safetensors"))
    te1 = {k.removeprefix("text_encoder."): v for k, v in final.items() if k.startswith("text_encoder.")}
    if adapter == "lora":
        base = {k.replace(".base_layer", ""): v for k, v in te1.items() if "lora_" not in k}
        assert all(torch.equal(base[k], original[k].to(base[k].dtype)) for k in original)
        assert any(v.abs().sum() > 0 for k, v in te1.items() if ".lora_B." in k)  # B starts at zero
    else:
        assert any(not torch.equal(te1[k], original[k]) for k in original)
    assert any(k.startswith("text_encoder_2.") for k in final) == (choice == "both")

    # the export, in the matching diffusers pipeline
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from zerotune.rundir.export import export

    out = tmp_path / "out"
    written = export(straight, out)
    if adapter == "lora":
        pipe = pipeline(parts[model], UNet2DConditionModel.from_config(json.loads(
            (straight / "checkpoints/step-0000004/config.json").read_text())))
        q_proj = next(m for n, m in pipe.text_encoder.named_modules() if n.endswith("q_proj"))
        before = q_proj.weight.detach().clone()
        pipe.load_lora_weights(out / "lora")
        assert set(pipe.get_list_adapters()) >= {"unet", "text_encoder"}
        pipe.fuse_lora(components=["unet", "text_encoder", *(["text_encoder_2"] if choice == "both" else [])])
        q_proj = next(m for n, m in pipe.text_encoder.named_modules() if n.endswith("q_proj"))
        assert not torch.equal(q_proj.weight, before)  # the encoder's adapter was in the file, and fused
    else:
        classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
        encoders = {n: cls.from_pretrained(written[n]) for n, cls in classes.items() if n in written}
        assert set(encoders) == ({"text_encoder", "text_encoder_2"} if choice == "both" else {"text_encoder"})
        pipe = pipeline(parts[model], UNet2DConditionModel.from_pretrained(written["unet"]), **encoders)
    image = draw(pipe, "a red dog")
    assert image.shape == (64, 64, 3) and np.isfinite(image).all() and image.std() > 0

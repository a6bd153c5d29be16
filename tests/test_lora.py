"""adapter=lora: only the adapter trains, under every ZeRO stage and offload; checkpoints resume exactly; the
export loads with diffusers' own loader and reproduces the engine; bad input is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.cli import (
    ROOT,
    call_main,
    cli_env,
    compose_cfg,
    config_of,
    preflight,
    read_summary,
    run_cli,
)
from zerotune import models
from zerotune.cli.export import main as export_main
from zerotune.config.errors import ConfigError
from zerotune.models import adapter
from zerotune.rundir import checkpoints, export, resume
from zerotune.rundir.checkpoint_io import full_state
from zerotune.rundir.resume import decide_resume

QUICK = ["adapter=lora", "train.batch_size=4", "train.log_every=1", "evaluate.enabled=false", "scheduler=warmup",
         "scheduler.warmup_steps=2", "precision=fp32"]
WEIGHTS = "pytorch_lora_weights.safetensors"


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/train"] for r in rows}


def train_ok(run_dir, *args) -> dict:
    proc = run_cli(*QUICK, *args, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary.get("error")
    return summary


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny U-Net with random weights, saved as a diffusers folder: the base the adapters train on."""
    folder = tmp_path_factory.mktemp("base") / "unet"
    torch.manual_seed(1)
    models.build_network(compose_cfg().model).save_pretrained(folder)
    return folder


def tiny_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 1, 8, 8, generator=g), torch.tensor([1, 100, 500, 900]),
            {"class_labels": torch.tensor([0, 3, 5, 10])})


def predict(unet, inputs) -> torch.Tensor:
    x, t, kwargs = inputs
    with torch.no_grad():
        return unet.eval()(x, t, None, **kwargs).sample


def check_export(run_dir, out, base) -> None:
    """The exported adapter, loaded by diffusers into a fresh base, and the merged U-Net, both give the engine's
    outputs; the base weights in the checkpoint and outside the adapted modules of the merge are the base's."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    proc = call_main(export_main, str(run_dir), str(out), "--merge")  # its process: tests/test_final_checkpoint.py
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = checkpoints.find(run_dir)
    weights = {k: v.float() for k, v in full_state(path, with_optimizer=False)[0].items()}
    engine = export.build(checkpoints.unet_config(path), checkpoints.read_meta(path)["adapter_config"], weights)
    fresh = UNet2DConditionModel.from_pretrained(base)
    fresh.load_lora_adapter(str(out / "lora"), prefix="unet", weight_name=WEIGHTS)
    merged = UNet2DConditionModel.from_pretrained(out / "unet")
    inputs = tiny_inputs()
    want = predict(engine, inputs)
    assert (predict(UNet2DConditionModel.from_pretrained(base), inputs) - want).abs().max() > 1e-4  # it learned
    for got in (predict(fresh, inputs), predict(merged, inputs)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    base_sd = load_file(str(base / "diffusion_pytorch_model.safetensors"))
    for name, tensor in base_sd.items():
        wrapped = name.rsplit(".", 1)[0] + ".base_layer." + name.rsplit(".", 1)[1]
        assert torch.equal(weights.get(wrapped, weights.get(name)), tensor), name  # bit-identical, frozen
    merged_sd = load_file(str(out / "unet.safetensors"))
    untouched = [n for n in base_sd if not n.split(".")[-2].startswith(("conv1", "conv2"))]
    assert untouched and all(torch.equal(merged_sd[n], base_sd[n]) for n in untouched)
    lora_keys = load_file(str(out / "lora" / WEIGHTS)).keys()
    # diffusers' LoRA file: `unet.`-prefixed module names, lora_A / lora_B, no adapter name
    assert lora_keys and all(k.startswith("unet.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
                             for k in lora_keys)


# ---------------------------------------------------------------- fast: rules and one real run


def test_only_the_adapter_is_trainable():
    cfg = config_of("adapter=lora")
    unet = adapter.add_adapter(models.build_network(cfg.model), cfg.adapter)
    trained = [n for n, p in unet.named_parameters() if p.requires_grad]
    assert trained and all(adapter.is_adapter_weight(n) for n in trained)
    assert len(adapter.trainable_parameters(unet)) == len(trained)
    stats = models.model_stats(cfg.model, cfg.adapter)
    # each conv1/conv2 (3x3) gets A: r x in x 3 x 3 and B: out x r x 1 x 1
    expected = sum(16 * m.in_channels * 9 + m.out_channels * 16 for n, m in models.build_network(cfg.model)
                   .named_modules() if n.rsplit(".", 1)[-1] in ("conv1", "conv2"))
    assert stats.num_trainable == expected and stats.num_frozen == models.model_stats(cfg.model).num_params
    plain = models.model_stats(cfg.model)
    assert plain.num_trainable == plain.num_params and plain.num_frozen == 0


def test_sdxl_defaults_to_the_attention_projections():
    cfg = compose_cfg("adapter=lora", "model=sdxl_tiny")
    assert list(cfg.adapter.target_modules) == ["to_q", "to_k", "to_v", "to_out.0"]
    unet = adapter.add_adapter(models.build_network(cfg.model), cfg.adapter)
    wrapped = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in unet.named_parameters() if ".lora_A." in n}
    assert wrapped == {"to_q", "to_k", "to_v", "0"}


BAD_ADAPTER_INPUT = [
    (["adapter.rank=0"], "adapter.rank", "at least 1"),
    (["adapter.target_modules=[to_qq]"], "adapter.target_modules", "conv1"),
    (["adapter.init=xavier"], "adapter.init", "gaussian"),
    (["optimizer=muadam"], "optimizer", "adamw"),
    (["adapter=dora"], "adapter", "lora"),
]


@pytest.mark.parametrize(("args", "key", "says"), BAD_ADAPTER_INPUT[1:])
def test_bad_adapter_input_is_a_config_error_naming_the_key(args, key, says):
    """What train.py composes and checks before any worker starts; the CLI prints every ConfigError alike (the
    first case, through the CLI, below)."""
    with pytest.raises(ConfigError) as err:
        preflight(compose_cfg("adapter=lora", *args))
    assert err.value.key == key and says in str(err.value), str(err.value)


def test_bad_adapter_input_exits_2_naming_the_key(tmp_path):
    args, key, says = BAD_ADAPTER_INPUT[0]
    proc = run_cli("adapter=lora", *args, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"`{key}`" in proc.stderr and says in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_checkpoint_resumes_only_with_its_adapter(tmp_path):
    folder = checkpoints.step_dir(tmp_path, 2)
    folder.mkdir(parents=True)
    meta = {"step": 2, "model": "tiny", "adapter": "none", "zero_stage": 2}
    (folder / checkpoints.META).write_text(json.dumps(meta))
    now = {**meta, "adapter": "lora rank=16 alpha=16.0 targets=conv1,conv2"}
    with pytest.raises(ConfigError, match="adapter") as err:
        decide_resume(folder, now, {})
    assert "model.pretrained=<out> adapter=lora" in err.value.fix  # train an adapter on the exported weights


@pytest.mark.slow
def test_lora_trains_checkpoints_and_exports_for_diffusers(tmp_path, pretrained):
    summary = train_ok(tmp_path / "run", f"model.pretrained={pretrained}", "zero_stage=2", "train.max_steps=3",
                       "checkpoint.every_n_steps=3", "ema.enabled=true")
    assert summary["choices"]["adapter"] == "lora-r16" and summary["trainable_params"] < summary["frozen_params"]
    assert summary["partition"]["grads_bytes"] == summary["trainable_params"] * 4  # gradients of the adapter only
    check_export(tmp_path / "run", tmp_path / "out", pretrained)
    assert (tmp_path / "out" / "lora_ema" / WEIGHTS).is_file()
    ema = torch.load(checkpoints.find(tmp_path / "run") / checkpoints.EMA_FILE, weights_only=True)["shadow"]
    assert ema and all(adapter.is_adapter_weight(n) for n in ema)  # the EMA averages the adapter alone


# ---------------------------------------------------------------- slow: every stage, ZeRO-3, kill -9


STAGES = [("0", "none"), ("1", "none"), ("1", "cpu"), ("2", "none"), ("2", "cpu"), ("3", "none"), ("3", "cpu"),
          ("3", "nvme")]


@pytest.mark.slow
def test_stages_agree(tmp_path, pretrained):
    """fp32, same seed: LoRA's losses for 6 steps agree across stages 0-3 x offload none/cpu (and NVMe at
    stage 3, the only stage that swaps) to 1e-5."""
    runs = {}
    for stage, offload in STAGES:
        run = tmp_path / f"s{stage}{offload}"
        nvme = [f"offload.path={tmp_path / 'swap'}"] if offload == "nvme" else []
        train_ok(run, f"model.pretrained={pretrained}", f"zero_stage={stage}", f"offload={offload}", *nvme,
                 "train.max_steps=6")
        runs[(stage, offload)] = losses(run)
    ref = runs[("0", "none")]
    assert len(ref) == 6 and ref[6] < ref[1]
    for key, got in runs.items():
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (key, step)


@pytest.mark.slow
def test_zero3_offload_export_round_trip(tmp_path, pretrained):
    train_ok(tmp_path / "run", f"model.pretrained={pretrained}", "zero_stage=3", "offload=cpu", "train.max_steps=4",
             "checkpoint.every_n_steps=4")
    check_export(tmp_path / "run", tmp_path / "out", pretrained)


@pytest.mark.slow
def test_resume_across_stages_with_an_adapter(tmp_path):
    ref = tmp_path / "s1"
    train_ok(ref, "zero_stage=1", "train.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0")
    expected, source = losses(ref), ref / "checkpoints" / "step-0000002"
    for stage, until, extra in ((3, 4, []), (0, 6, ["deepspeed.enabled=false"])):
        run = tmp_path / f"s{stage}"
        summary = train_ok(run, f"zero_stage={stage}", *extra, f"train.max_steps={until}",
                           "checkpoint.every_n_steps=2", f"resume={source}")
        assert summary["checkpoint"]["resumed_from"]["mode"] == ("full" if stage == 0 else "universal")
        for step, loss in losses(run).items():
            assert loss == pytest.approx(expected[step], rel=1e-5), (stage, step)
        source = run / "checkpoints" / f"step-{until:07d}"


@pytest.mark.slow
def test_kill_9_then_resume_continues_exactly(tmp_path):
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    cmd = [sys.executable, str(ROOT / "train.py"), *QUICK, "zero_stage=2", "offload=cpu", "train.max_steps=200",
           "checkpoint.every_n_steps=2", f"hydra.run.dir={killed}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 400
        while (last := checkpoints.latest(killed / "checkpoints")) is None or last.name < "step-0000004":
            assert proc.poll() is None and time.time() < deadline, "no checkpoint written"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    step = checkpoints.read_meta(checkpoints.latest(killed / "checkpoints"))["step"]
    before = losses(killed)
    summary = train_ok(resumed, "zero_stage=2", "offload=cpu", f"train.max_steps={step + 2}",
                       "checkpoint.every_n_steps=2", "resume=latest", f"checkpoint.dir={killed / 'checkpoints'}")
    assert summary["checkpoint"]["resumed_from"]["step"] == step
    after = losses(resumed)
    assert min(after) == step + 1
    replayed = [s for s in after if s in before]
    for s in replayed:
        assert after[s] == pytest.approx(before[s], rel=1e-6)


def test_meta_records_the_adapter_config():
    cfg = config_of("adapter=lora", "adapter.rank=4")
    meta = resume.current_meta(cfg, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, True, 1)
    assert meta["adapter_config"]["rank"] == 4 and meta["adapter"].startswith("lora rank=4")
    assert OmegaConf.create(meta["adapter_config"]).target_modules == ["conv1", "conv2"]

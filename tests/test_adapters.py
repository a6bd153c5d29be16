"""Adapters beyond LoRA, through peft: adapter=loha, adapter=lokr and adapter=lora adapter.dora=true. Each trains
only itself at ZeRO-2, resumes exactly at ZeRO-3 from a ZeRO-2 checkpoint, and exports what plain peft (LoHa, LoKr)
or diffusers' LoRA loader (DoRA) loads, reproducing the engine; the planner counts its parameters exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import call_main, compose_cfg, config_of, read_summary, run_cli
from tests.helpers.fixes import refused_with_fixes
from zerotune import models
from zerotune.cli.export import main as export_main
from zerotune.config.errors import ConfigError
from zerotune.models import adapter
from zerotune.rundir import checkpoints, export
from zerotune.rundir.checkpoint_io import full_state

KINDS = {"loha": ("adapter=loha",), "lokr": ("adapter=lokr",), "dora": ("adapter=lora", "adapter.dora=true")}
QUICK = ("train.batch_size=4", "train.log_every=1", "evaluate.enabled=false", "scheduler=constant",
         "optimizer.lr=1e-3", "precision=fp32", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny U-Net with random weights, saved as a diffusers folder: the base the adapters train on."""
    folder = tmp_path_factory.mktemp("adapter_base") / "unet"
    torch.manual_seed(1)
    models.build_network(compose_cfg().model).save_pretrained(folder)
    return folder


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/train"] for r in rows}


def _train(run: Path, *args: str) -> dict:
    proc = run_cli(*args, *QUICK, f"hydra.run.dir={run}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "ok", summary.get("error")
    return summary


def _predict(unet, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(4, 1, 8, 8, generator=g), torch.tensor([1, 100, 500, 900])
    with torch.no_grad():
        return unet.eval()(x, t, None, class_labels=torch.tensor([0, 3, 5, 10])).sample


def _loaded(kind: str, out: Path, base: Path):
    """The export in a fresh base as its users load it: LoHa / LoKr by plain peft (the folder's adapter_config.json
    and adapter_model.safetensors), DoRA by diffusers' LoRA loader."""
    from diffusers import UNet2DConditionModel

    fresh = UNet2DConditionModel.from_pretrained(base)
    if kind == "dora":
        fresh.load_lora_adapter(str(out / "lora"), prefix="unet", weight_name=export.WEIGHT_NAME)
        return fresh
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = out / kind / "unet"
    config = PeftConfig.from_pretrained(str(folder))
    inject_adapter_in_model(config, fresh)
    result = set_peft_model_state_dict(fresh, load_file(str(folder / export.PEFT_WEIGHTS)))
    assert not result.unexpected_keys
    return fresh


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_adapter_trains_resumes_exactly_and_exports(kind, tmp_path, base):
    straight = tmp_path / "straight"
    summary = _train(straight, *KINDS[kind], f"model.pretrained={base}", "zero_stage=2", "train.max_steps=4")
    assert summary["choices"]["adapter"] == {"loha": "loha-r8", "lokr": "lokr-r8", "dora": "lora-r16-dora"}[kind]
    stats = models.model_stats(config_of(*KINDS[kind]).model, config_of(*KINDS[kind]).adapter)
    # the planner's count is the run's: the adapter's parameters on top of the frozen base; it planned the step
    assert summary["plan"].get("error") is None and summary["plan"]["step_peak_mib"] > 0
    assert summary["trainable_params"] == stats.num_trainable > 0
    assert summary["num_params"] == stats.num_params and summary["frozen_params"] == stats.num_params - stats.num_trainable
    path = checkpoints.find(straight)
    weights = {k: v.float() for k, v in full_state(path, with_optimizer=False)[0].items()}
    trained = [n for n in weights if adapter.is_adapter_weight(n)]
    assert len(trained) == len(stats.trainable_numels)
    straight_losses = _losses(straight)

    # resumed from step 2 at ZeRO-3 (DeepSpeed's universal checkpoint): steps 3 and 4 are the straight run's
    resumed = tmp_path / "resumed"
    _train(resumed, *KINDS[kind], f"model.pretrained={base}", "zero_stage=3", "train.max_steps=4",
           f"resume={straight / 'checkpoints' / 'step-0000002'}")
    for step, loss in _losses(resumed).items():
        assert loss == pytest.approx(straight_losses[step], rel=1e-5), (step, _losses(resumed), straight_losses)

    out = tmp_path / "out"
    proc = call_main(export_main, str(straight), str(out), "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = export.build(checkpoints.unet_config(path), checkpoints.read_meta(path)["adapter_config"], weights)
    want = _predict(engine)
    from diffusers import UNet2DConditionModel

    assert (_predict(UNet2DConditionModel.from_pretrained(base)) - want).abs().max() > 1e-4  # it learned
    for got in (_predict(_loaded(kind, out, base)), _predict(UNet2DConditionModel.from_pretrained(out / "unet"))):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_layer_names_are_pefts():
    from peft.tuners.loha.layer import LoHaLayer
    from peft.tuners.lokr.layer import LoKrLayer
    from peft.tuners.lora.layer import LoraLayer

    assert set(adapter.ADAPTER_LAYER_NAMES) == {*LoraLayer.adapter_layer_names, *LoHaLayer.adapter_layer_names,
                                                *LoKrLayer.adapter_layer_names}


@pytest.mark.parametrize("overrides,key", [
    (["adapter=loha", "adapter.dora=true"], "adapter.dora"),
    (["adapter=lokr", "adapter.init=gaussian"], "adapter.init"),
    (["adapter=lora", "adapter.name=lycoris"], "adapter.name"),
])
def test_bad_adapter_settings_are_refused_with_a_fix(overrides, key, tmp_path):
    err, fixes = refused_with_fixes(overrides, tmp_path)
    assert err.key == key, err
    assert fixes >= 1


def test_a_dora_checkpoint_resumes_only_as_dora(tmp_path):
    from zerotune.rundir.resume import current_meta, decide_resume

    ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    folder = tmp_path / "step-0000002"
    folder.mkdir()
    (folder / checkpoints.META).write_text(json.dumps({**current_meta(config_of(*KINDS["dora"]), ds, True, 1),
                                                       "step": 2}))
    with pytest.raises(ConfigError, match="adapter"):
        decide_resume(folder, current_meta(config_of("adapter=lora"), ds, True, 1), {})

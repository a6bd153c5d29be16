"""Original-layout single-file checkpoints (`model.pretrained=<checkpoint>.safetensors`, as A1111 and ComfyUI
load them), made here from a diffusers U-Net with diffusers' own conversion (tests/helpers/original_layout.py)
and loaded through diffusers' `from_single_file`. ZeRO-3's partitioned load: tests/test_zero3_init.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.cli import compose_cfg, run_cli
from tests.helpers.original_layout import original_layout, original_unet, write_checkpoint
from zerotune.config.errors import ConfigError
from zerotune.models import build_network, check_pretrained


def _source(model: str, *overrides: str):
    """A diffusers U-Net of the model option's architecture, its weights not the seeded init a run makes."""
    torch.manual_seed(5)
    unet = build_network(compose_cfg(f"model={model}", "data=synthetic", *overrides).model)
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(torch.randn_like(p))
    return unet


def _cfg(model: str, path, *overrides: str):
    return compose_cfg(f"model={model}", "data=synthetic", f"model.pretrained={path}", *overrides)


@pytest.mark.parametrize("model", ["sd15_tiny", "sdxl_tiny"])
def test_a_single_file_loads_equal_to_the_model_it_was_made_from(model, tmp_path):
    source = _source(model)
    path = write_checkpoint(source, tmp_path / "checkpoint.safetensors")
    cfg = _cfg(model, path)
    check_pretrained(cfg.model)
    loaded = build_network(cfg.model).state_dict()
    expected = source.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(loaded[name].dtype == torch.float32 and torch.equal(loaded[name], expected[name]) for name in expected)


def test_a_half_precision_file_loads_in_fp32(tmp_path):
    """Community checkpoints are mostly fp16; the master weights train in fp32."""
    from safetensors.torch import save_file

    source = _source("sd15_tiny")
    save_file({name: t.half() for name, t in original_layout(source).items()}, str(tmp_path / "half.safetensors"))
    loaded = build_network(_cfg("sd15_tiny", tmp_path / "half.safetensors").model).state_dict()
    expected = source.state_dict()
    assert all(loaded[name].dtype == torch.float32 and torch.equal(loaded[name], expected[name].half().float())
               for name in expected)


def test_the_loaded_u_net_computes_what_the_original_model_computes(tmp_path):
    """Equal weights under the right names are not enough if a tensor lands transposed or in the wrong block:
    the original UNetModel, holding the file's tensors, and the loaded diffusers U-Net give one output. (32
    norm groups: the original code has no other count.)"""
    from diffusers.loaders.single_file_utils import LDM_UNET_KEY

    groups = "model.unet.norm_num_groups=32"
    source = _source("sd15_tiny", groups)
    path = write_checkpoint(source, tmp_path / "checkpoint.safetensors")
    loaded = build_network(_cfg("sd15_tiny", path, groups).model).eval()
    original = original_unet(dict(source.config)).eval()
    original.load_state_dict({name.removeprefix(LDM_UNET_KEY): t for name, t in original_layout(source).items()})
    torch.manual_seed(0)
    sample, timesteps, context = torch.randn(2, 4, 16, 16), torch.tensor([10, 700]), torch.randn(2, 7, 32)
    with torch.no_grad():
        ours = loaded(sample, timesteps, encoder_hidden_states=context).sample
        theirs = original(sample, timesteps, context=context)
    scale = ours.abs().max().item()
    assert scale > 0.1
    # float rounding only (attention and norms are computed in another order; PyPI's CUDA build of torch rounds
    # its CPU kernels otherwise, up to 1.3e-6 of the scale measured): a misplaced tensor is off by the scale itself
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize(("made", "named", "says"), [
    ("sd15_tiny", "sdxl_tiny", "without the U-Net tensor 'label_emb.0.0.weight'"),
    ("sdxl_tiny", "sd15_tiny", "does not match model=sd15_tiny"),
])
def test_a_checkpoint_of_another_architecture_is_refused_with_a_fix_that_works(made, named, says, tmp_path):
    path = write_checkpoint(_source(made), tmp_path / "checkpoint.safetensors")
    with pytest.raises(ConfigError) as err:
        check_pretrained(_cfg(named, path).model)
    assert err.value.key == "model.pretrained" and says in err.value.problem, err.value.problem
    assert err.value.fix.startswith(f"model={made} ")
    check_pretrained(_cfg(made, path).model)  # the fix, applied


def test_train_from_a_single_file(tmp_path):
    """The user's command: a checkpoint file as the starting point of a run."""
    path = write_checkpoint(_source("sd15_tiny"), tmp_path / "checkpoint.safetensors")
    run = tmp_path / "run"
    proc = run_cli("model=sd15_tiny", "data=synthetic", f"model.pretrained={path}", "resolution.size=32",
                   "train.max_steps=2", "train.batch_size=2", "evaluate.enabled=false", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2, summary.get("error")


ORIGINAL_SD = {  # the published configs' UNetModel arguments (v1-inference.yaml, v2-inference-v.yaml)
    "sd15": dict(num_heads=8, context_dim=768),
    "sd21": dict(num_heads=-1, num_head_channels=64, context_dim=1024, use_linear_in_transformer=True),
}


@pytest.mark.parametrize(("model", "other"), [("sd15", "sd21"), ("sd21", "sd15")])
def test_the_published_sd_layouts_pass_their_option_and_are_named_under_the_other(model, other, tmp_path,
                                                                               monkeypatch):
    """The full-size SD 1.5 and 2.1 layouts (the original model's names and shapes, built on the meta device,
    as the header of a real checkpoint lists them): checked against the right option, and named as the fix
    under the wrong one."""
    from diffusers.loaders.single_file_utils import LDM_UNET_KEY
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    import zerotune.models as models

    with torch.device("meta"):
        original = UNetModel(image_size=64, in_channels=4, out_channels=4, model_channels=320,
                             attention_resolutions=[4, 2, 1], num_res_blocks=2, channel_mult=[1, 2, 4, 4],
                             use_spatial_transformer=True, transformer_depth=1, legacy=False, **ORIGINAL_SD[model])
    header = {LDM_UNET_KEY + name: tuple(t.shape) for name, t in original.state_dict().items()}
    header["first_stage_model.decoder.conv_in.weight"] = (512, 4, 3, 3)
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(b"")  # its header is the one above
    monkeypatch.setattr(models, "read_shapes", lambda file: header)
    check_pretrained(_cfg(model, path).model)
    with pytest.raises(ConfigError) as err:
        check_pretrained(_cfg(other, path).model)
    assert err.value.fix.startswith(f"model={model} "), err.value

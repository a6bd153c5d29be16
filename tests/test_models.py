"""Model construction: SDXL's architecture, and loading a U-Net from a local path."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.cli import compose_cfg
from zerotune.config.errors import ConfigError
from zerotune.models import build_network, latent_shape, model_stats

SDXL_UNET_PARAMS = 2_567_463_684


def test_sdxl_architecture_has_sdxl_parameter_count():
    stats = model_stats(compose_cfg("model=sdxl", "data=synthetic").model)
    assert stats.num_params == SDXL_UNET_PARAMS


def test_sdxl_latent_shape():
    cfg = compose_cfg("model=sdxl", "data=synthetic", "resolution=1024")
    assert latent_shape(cfg.model, cfg.resolution.size) == (4, 128, 128)


def _tiny_forward(unet) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(2, 1, 16, 16)
    return unet(x, torch.tensor([10, 500]), encoder_hidden_states=None, class_labels=torch.tensor([3, 10])).sample


def test_load_pretrained_folder_and_safetensors(tmp_path):
    cfg = compose_cfg()
    torch.manual_seed(1)
    saved = build_network(cfg.model)
    saved.save_pretrained(tmp_path / "unet")
    save_file(saved.state_dict(), str(tmp_path / "unet.safetensors"))
    expected = _tiny_forward(saved.eval())

    for path in (tmp_path / "unet", tmp_path, tmp_path / "unet.safetensors"):  # tmp_path: a pipeline folder
        loaded = build_network(compose_cfg(f"model.pretrained={path}").model).eval()
        assert torch.equal(_tiny_forward(loaded), expected), path


def test_pretrained_errors(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_network(compose_cfg(f"model.pretrained={tmp_path}/missing").model)
    assert err.value.key == "model.pretrained"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no diffusers U-Net"):
        build_network(compose_cfg(f"model.pretrained={tmp_path}/empty").model)
    save_file({"nope": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="does not match model=tiny"):
        build_network(compose_cfg(f"model.pretrained={tmp_path}/other.safetensors").model)

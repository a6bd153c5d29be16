"""data.invert: the digits drawn inverted (ink <-> paper), what reaches the data set, what refuses it, and the
scores that tell the two polarities apart (quality.inverted_fraction, DigitClassifier(invert=True))."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cli import compose_cfg, run_cli
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.data import build_dataset, check_data
from zerotune.data.sources import DigitsDataset
from zerotune.data.spec import DataSpec
from zerotune.train.evaluate import DigitClassifier, border_brightness, inverted_fraction


def test_inverted_digits_are_the_normal_ones_with_ink_and_paper_swapped():
    normal, inverted = DigitsDataset(size=16, split="all"), DigitsDataset(size=16, split="all", invert=True)
    # x -> 16 - x in raw units is x -> -x after the [-1, 1] mapping, and bilinear resizing keeps it so.
    torch.testing.assert_close(inverted.pixel_values, -normal.pixel_values)
    assert torch.equal(inverted.class_labels, normal.class_labels)
    assert normal.pixel_values[..., 0].mean() < -0.9 < 0.9 < inverted.pixel_values[..., 0].mean()  # left edge: paper


def test_the_option_reaches_the_data_set():
    cfg = compose_cfg()
    assert cfg.data.invert is False
    normal = build_dataset(DataSpec.from_config(cfg))
    inverted = build_dataset(DataSpec.from_config(compose_cfg("data.invert=true")))
    assert len(inverted) == len(normal) == 1797
    torch.testing.assert_close(inverted[5]["x0"], -normal[5]["x0"])


@pytest.mark.parametrize("data", ["synthetic", "folder"])
def test_other_data_sets_refuse_it(data):
    spec = DataSpec.from_config(compose_cfg(f"data={data}", "data.invert=true", "model=sdxl_tiny"))
    with pytest.raises(ConfigError) as err:
        check_data(spec)
    assert err.value.key == "data.invert"
    assert f"data={data}" in err.value.problem and "data=digits" in err.value.fix


def test_the_command_line_refuses_it_before_training(tmp_path):
    proc = run_cli("data=synthetic", "data.invert=true", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr[-2000:]
    assert "`data.invert`" in proc.stderr and "fix: data.invert=false" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_scores_tell_the_polarities_apart():
    normal, inverted = DigitsDataset(size=8, split="all"), DigitsDataset(size=8, split="all", invert=True)
    assert inverted_fraction(normal.pixel_values) == 0.0 and inverted_fraction(inverted.pixel_values) == 1.0
    assert border_brightness(normal.pixel_values).max() < 8 < border_brightness(inverted.pixel_values).min()
    upright, flipped = DigitClassifier(), DigitClassifier(invert=True)
    assert flipped.holdout_accuracy > 0.95
    assert flipped.accuracy(inverted.pixel_values, inverted.class_labels) > 0.95
    # each classifier takes the other polarity for one class: chance level
    assert flipped.accuracy(normal.pixel_values, normal.class_labels) < 0.2
    assert upright.accuracy(inverted.pixel_values, inverted.class_labels) < 0.2

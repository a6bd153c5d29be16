"""The fine-tuner's features together at 2 processes under ZeRO-3: LoHa, masked loss, shuffled tags with caption
dropout, TensorBoard, and one validation prompt, which rank 0 samples alone while rank 1 waits (with DeepSpeed's
start-of-forward hook left on, rank 0's first solo forward waited for rank 1 forever)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.cli import read_summary, run_cli
from tests.helpers.folder_fixtures import noise_images
from zerotune.rundir.loggers import TENSORBOARD_DIR


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = noise_images(tmp_path_factory.mktemp("two_process_images"),
                        ("cat, blue, sofa, photo", "dog, red, grass, photo"), seed=3)
    half = np.zeros((64, 64), dtype=np.uint8)
    half[:, 32:] = 255
    for i in range(0, 8, 2):
        Image.fromarray(half).save(root / f"{i}.mask.png")
    return root


def test_two_processes_at_zero3_train_validate_and_log(images, tiny_sdxl_components, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = run_cli("model=sdxl_tiny", "data=folder", f"data.path={images}", f"model.components={tiny_sdxl_components}",
                   "resolution.size=64", "train.batch_size=2", f"data.cache_dir={tmp_path / 'cache'}",
                   "data.masked_loss=true", "data.shuffle_tags=true", "data.keep_tags=1", "data.caption_dropout=0.2",
                   "adapter=loha", "zero_stage=3", "launch.num_processes=2", "train.max_steps=3", "train.log_every=1",
                   "logger=tensorboard", 'validation.prompts=["a dog"]', "validation.steps=2",
                   f"hydra.run.dir={run}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["plan"].get("error") is None
    assert [p["step"] for p in summary["validation"]["passes"]] == [0, 3]
    assert summary["validation"]["failed_passes"] == 0
    assert summary["data"]["masks"]["mask_files"] == 4 and summary["data"]["caption_rules"]["variants_per_caption"] == 4
    events = EventAccumulator(str(next((run / TENSORBOARD_DIR).glob("events.out.tfevents.*"))))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/train")] == [1, 2, 3]
    assert "validation/00-a-dog" in events.Tags()["images"]

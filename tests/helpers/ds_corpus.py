"""tests/data/ds_configs: DeepSpeed JSON files and accelerate YAMLs as public repositories write them, and
tests/data/ds_configs/expected.yaml, what must happen to each."""

from __future__ import annotations

import yaml

from tests.helpers.cli import ROOT

CORPUS = ROOT / "tests" / "data" / "ds_configs"
EXPECTED = yaml.safe_load((CORPUS / "expected.yaml").read_text())
QUICK = ["train.max_steps=2", "train.log_every=1", "evaluate.enabled=false"]  # a file's run through the CLI


def file_override(name: str) -> list[str]:
    if name.endswith(".yaml"):
        return [f"accelerate.config_file={CORPUS / name}"]
    return [f"deepspeed.config_file={CORPUS / name}", "accelerate.config_file=null"]

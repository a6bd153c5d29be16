"""Compose configs in-process, and run the real CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from zerotune import CONF_DIR
from zerotune.cli.overrides import normalize_overrides, with_search_path

ROOT = Path(__file__).resolve().parents[2]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config",
                       overrides=with_search_path(normalize_overrides(list(overrides), CONF_DIR), CONF_DIR))


def cli_env() -> dict:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str, cwd: Path = ROOT, timeout: int = 900, module: str | None = None):
    """Run `python train.py ARGS` (or `python -m MODULE ARGS`) and return the CompletedProcess."""
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(ROOT / "train.py")]
    return subprocess.run([*cmd, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss/train"] for r in rows]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())

"""The run directory: one folder holds everything about a run. File names here are a contract."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

CONFIG = "config.yaml"
DS_CONFIG = "ds_config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
SAMPLES = "samples"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a diverged loss is recorded as null and flagged by status
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path: str | Path, is_writer: bool = True):
        self.path = Path(path)
        self.is_writer = is_writer  # only one process (rank 0) writes shared files
        if is_writer:
            (self.path / SAMPLES).mkdir(parents=True, exist_ok=True)
        self._metrics = None

    def file(self, name: str) -> Path:
        return self.path / name

    def write_config(self, cfg: Any) -> None:
        if self.is_writer:
            tmp = self.path / f".{CONFIG}.tmp"
            tmp.write_text(OmegaConf.to_yaml(cfg, resolve=True))
            os.replace(tmp, self.path / CONFIG)

    def write_ds_config(self, ds: dict) -> None:
        if self.is_writer:
            write_json_atomic(self.path / DS_CONFIG, ds)

    def log_metrics(self, row: dict) -> None:
        """Append one JSON line and flush it, so a crash keeps every step logged before it."""
        if not self.is_writer:
            return
        if self._metrics is None:
            self._metrics = open(self.path / METRICS, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._metrics.write(json.dumps(_jsonable(row)) + "\n")

    def write_summary(self, summary: dict) -> None:
        if self.is_writer:
            write_json_atomic(self.path / SUMMARY, summary)

    def read_summary(self) -> dict | None:
        file = self.path / SUMMARY
        return json.loads(file.read_text()) if file.is_file() else None

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

"""The run directory: one folder holds everything about a run, and the job spec the parent writes into it for
its workers. File names here are a contract."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from omegaconf import OmegaConf

from zerotune.config.files import jsonable, write_json_atomic, write_text_atomic
from zerotune.config.schema import Config
from zerotune.rundir.summary import SUMMARY, RunSummary

__all__ = ["RunDir", "ATTEMPTS", "CONFIG", "DS_CONFIG", "METRICS", "SUMMARY", "SAMPLES"]

CONFIG = "config.yaml"
DS_CONFIG = "ds_config.json"
METRICS = "metrics.jsonl"
SAMPLES = "samples"
ATTEMPTS = "attempts"
# What one run writes about itself; checkpoints/ and the launcher's logs/ (a folder per launch) stay in place.
_RECORDS = (CONFIG, DS_CONFIG, METRICS, SUMMARY, SAMPLES, "job.json", "launch.json", "resolved.json", "telemetry.png", "ranks")


class RunDir:
    def __init__(self, path: str | Path, is_writer: bool = True):
        self.path = Path(path)
        self.is_writer = is_writer  # only one process (rank 0) writes shared files
        if is_writer:
            (self.path / SAMPLES).mkdir(parents=True, exist_ok=True)
        self._metrics: TextIO | None = None

    def archive_previous_attempt(self, started: float | None = None) -> Path | None:
        """Move an earlier run's records (a rerun, a resume in place) to attempts/<n>/ before this run writes its
        own. `started` (a time.time()): files written since are this run's, by its other nodes, and stay."""
        found = [p for p in self.path.iterdir() if (p.name in _RECORDS or p.name.startswith(("summary.node", "resolved.node")))
                 and (started is None or p.stat().st_mtime < started)]
        if not any(p.name in (CONFIG, SUMMARY) for p in found):
            return None
        dest = self.path / ATTEMPTS / str(len(self.previous_attempts()) + 1)
        dest.mkdir(parents=True)
        for p in found:
            os.replace(p, dest / p.name)
        if self.is_writer:
            (self.path / SAMPLES).mkdir(exist_ok=True)
        return dest

    def previous_attempts(self) -> list[str]:
        folder = self.path / ATTEMPTS
        found = sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) \
            if folder.is_dir() else []
        return [str(p.relative_to(self.path)) for p in found]

    def file(self, name: str) -> Path:
        return self.path / name

    def write_config(self, cfg: Config) -> None:
        """config.yaml: the config the run resolved to, written once (a rerun's earlier one is archived first)."""
        if not self.is_writer:
            return
        if (self.path / CONFIG).exists():
            raise RuntimeError(f"{self.path / CONFIG} is written once per run, and it exists already")
        write_text_atomic(self.path / CONFIG, OmegaConf.to_yaml(cfg, resolve=True))

    def write_ds_config(self, ds: dict) -> None:
        if self.is_writer:
            write_json_atomic(self.path / DS_CONFIG, ds)

    def log_metrics(self, row: dict) -> None:
        """Append one JSON line and flush it, so a crash keeps every step logged before it."""
        if not self.is_writer:
            return
        if self._metrics is None:
            self._metrics = open(self.path / METRICS, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._metrics.write(json.dumps(jsonable(row)) + "\n")

    def write_summary(self, summary: RunSummary) -> None:
        if self.is_writer:
            summary.write(self.path)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


SPEC_FILE = "job.json"
SPEC_FILE_BEFORE = "launch.json"          # the same spec, as run directories written before job.json name it
MAX_NAME_LEN = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")


@dataclass
class JobSpec:
    run_dir: str
    run_name: str = "default"             # from the overrides; W&B's run name
    group: str | None = None              # the sweep id under -m; W&B's group
    overrides: list[str] = field(default_factory=list)
    from_parent: bool = False             # a zerotune parent resolved this job and holds its checkpoint dir's lock

    def save(self) -> None:
        write_json_atomic(Path(self.run_dir) / SPEC_FILE, asdict(self))

    @classmethod
    def load(cls, run_dir: str | Path) -> JobSpec:
        path = Path(run_dir) / SPEC_FILE
        if not path.exists() and (Path(run_dir) / SPEC_FILE_BEFORE).exists():
            path = Path(run_dir) / SPEC_FILE_BEFORE
        return cls(**json.loads(path.read_text()))


def run_name(overrides: list[str]) -> str:
    """["zero_stage=2", "offload=cpu"] -> "zero_stage=2,offload=cpu"; [] -> "default". Filesystem-safe; names
    over MAX_NAME_LEN are cut and suffixed with a hash of the full name, so distinct long ones stay distinct."""
    if not overrides:
        return "default"
    name = ",".join(_UNSAFE.sub("_", o.strip().replace("/", "-")) for o in overrides).lstrip(".-") or "default"
    if len(name) > MAX_NAME_LEN:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME_LEN - 9]}-{digest}"
    return name

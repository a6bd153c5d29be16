"""What a worker needs to know beyond config.yaml: written by the parent into the run directory."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPEC_FILE = "launch.json"


@dataclass
class JobSpec:
    run_dir: str
    run_name: str = "default"             # from the overrides; W&B's run name
    group: str | None = None              # the sweep id under -m; W&B's group
    overrides: list[str] = field(default_factory=list)

    def save(self) -> None:
        (Path(self.run_dir) / SPEC_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: str | Path) -> JobSpec:
        return cls(**json.loads((Path(run_dir) / SPEC_FILE).read_text()))

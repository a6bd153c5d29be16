"""What a worker needs to know beyond config.yaml: written by the parent into the run directory."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zerotune.files import write_json_atomic

SPEC_FILE = "launch.json"
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
        return cls(**json.loads((Path(run_dir) / SPEC_FILE).read_text()))


def run_name(overrides: list[str]) -> str:
    """["zero_stage=2", "offload=cpu"] -> "zero_stage=2,offload=cpu"; [] -> "default".

    Filesystem-safe ("/" -> "-", anything else unusual -> "_"); names longer than MAX_NAME_LEN are cut and
    suffixed with a hash of the full name so that distinct long override sets stay distinct.
    """
    if not overrides:
        return "default"
    name = ",".join(_UNSAFE.sub("_", o.strip().replace("/", "-")) for o in overrides).lstrip(".-") or "default"
    if len(name) > MAX_NAME_LEN:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME_LEN - 9]}-{digest}"
    return name

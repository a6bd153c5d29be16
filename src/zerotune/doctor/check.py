"""One check's finding, and the report of them all as text or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

OK, INFO, WARN, FAIL = "OK", "INFO", "WARN", "FAIL"
PROBLEMS = (WARN, FAIL)


@dataclass
class Check:
    name: str
    status: str                 # OK | INFO | WARN | FAIL
    summary: str                # one line: what was found
    fix: str = ""               # for a WARN or FAIL: what to do about it
    details: dict = field(default_factory=dict)  # the facts behind the line, for --json

    def __post_init__(self) -> None:
        if self.status in PROBLEMS and not self.fix:
            raise ValueError(f"check {self.name}: a {self.status} needs its fix")


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def as_text(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.summary}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (FAIL, WARN)}
    lines.append(f"{counts[FAIL]} failed, {counts[WARN]} warning(s)")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> str:
    # "failed": how many checks failed (doctor's own words, not a run's status)
    return json.dumps({"checks": [asdict(c) for c in checks], "failed": sum(c.status == FAIL for c in checks),
                       "warnings": sum(c.status == WARN for c in checks)}, indent=2, default=str)

"""Where each ZeRO stage's rules live: one module per stage family, each with the same four rules
(states, buffers, step_transients, loading)."""

from __future__ import annotations

from types import ModuleType

from zerotune.plan import stage0, zero3, zero12


def rules_for(stage: int) -> ModuleType:
    """The module holding stage `stage`'s rules (0 also for plain accelerate: nothing partitioned)."""
    return {0: stage0, 1: zero12, 2: zero12, 3: zero3}[stage]

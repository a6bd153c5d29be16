"""Units every part shares: bytes per MiB, and bytes per element of the precisions a run trains in."""

from __future__ import annotations

MIB = 2**20
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

"""`python -m zerotune.ops`: build DeepSpeed's CPU ops into the torch extensions cache now, as `make setup` does, so
that the first job (and the first test) loads them instead of compiling them. What a ZeRO-2 job with CPU offload
and DeepSpeed's AdamW loads: the shared-memory collectives every DeepSpeed job loads, and CPU Adam."""

from __future__ import annotations

import logging
import sys

from zerotune.ops.build import prebuild_ops

OFFLOAD_CPU = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
               "optimizer": {"type": "AdamW", "params": {}}}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        record = prebuild_ops(OFFLOAD_CPU, use_deepspeed=True)
    except Exception as exc:  # noqa: BLE001  (a job builds them again at its start, and says why it could not)
        print(f"zerotune.ops: DeepSpeed's CPU ops did not build: {exc}", file=sys.stderr)
        return 1
    print(f"zerotune.ops: {', '.join(op['name'] for op in record['ops'])} ready in {record['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""plan/zero12.py's loading phase, group by group, against what DeepSpeed's ZeRO-2 really allocates while it takes
the groups (tests/helpers/zero12_loading_probe.py counts every storage alive on the CPU accelerator). The CPU has
no caching allocator, so the bytes compared are allocated ones (`held=sum`); the card's reserve is the same
sequence with allocator.reserved_bytes, plus each group's freed blocks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import ROOT, cli_env
from zerotune.plan.zero12 import group_loads


def probe(groups: int, dtype: str, port: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.zero12_loading_probe", str(groups), dtype, str(port)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("groups", "dtype"), [(1, "bf16"), (4, "bf16"), (16, "bf16"), (3, "fp32")])
def test_the_loading_peak_per_group_is_what_zero2_allocates(groups, dtype):
    found = probe(groups, dtype, 29620 + groups + (50 if dtype == "fp32" else 0))
    elem = {"bf16": 2, "fp32": 4}[dtype]
    loads = group_loads(found["groups"], [], elem, 4, 1, False, False, None, held=sum)
    assert len(loads) == len(found["groups"]) == min(groups, len(found["groups"]))
    predicted = max(g.allocated for g in loads)
    # flatten_dense_tensors_aligned pads each group to 2 x world elements: a few bytes per group
    assert predicted == pytest.approx(found["peak_bytes"], abs=8 * len(loads))


def test_more_groups_lower_the_loading_peak_toward_one_copy():
    """bf16 without offload: 1 group holds blocks + flat + clone + fp32 master at once; K groups only 1/K of all
    but the blocks."""
    sizes = [[1_000_000] * 64]
    peaks = {k: max(g.allocated for g in group_loads([sizes[0][i::k] for i in range(k)], [], 2, 2, 1, False, True,
                                                     None, held=sum)) for k in (1, 16)}
    weights = 64 * 1_000_000 * 2
    assert peaks[1] == 2 * weights  # at the clone: the flat buffer and the clone (the blocks were freed)
    assert peaks[16] == pytest.approx(weights * (1 + 1 / 16), rel=1e-6)  # all blocks + the first group's flat

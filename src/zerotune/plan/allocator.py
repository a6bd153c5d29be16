"""torch's CUDA caching allocator, as documented in c10/cuda/CUDACachingAllocator.cpp: what a set of live
tensors reserves (what nvidia-smi counts) beyond their exact bytes. Rules, no fitted factor:

- every block is rounded up to 512 bytes (kMinBlockSize);
- blocks of at most 1 MiB (kSmallSize) are cut from 2 MiB segments (kSmallBuffer);
- blocks up to 10 MiB (kMinLargeAlloc) are cut from 20 MiB segments (kLargeBuffer);
- larger blocks get a segment of their own, rounded up to 2 MiB (kRoundLarge).

Packing is taken as perfect (blocks of one pool fill its segments end to end), so this is the least the
allocator can reserve for those tensors; fragmentation from frees in between comes on top.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MIN_BLOCK = 512
SMALL_SIZE, SMALL_SEGMENT = 1 << 20, 2 << 20
MIN_LARGE_ALLOC, LARGE_SEGMENT, ROUND_LARGE = 10 << 20, 20 << 20, 2 << 20


def _round_up(n: int, to: int) -> int:
    return int(math.ceil(n / to) * to) if n else 0


def reserved_bytes(sizes: Iterable[int]) -> int:
    """Bytes the allocator reserves to hold tensors of these sizes (bytes) alive at once."""
    small = medium = large = 0
    for size in sizes:
        block = _round_up(int(size), MIN_BLOCK)
        if block <= SMALL_SIZE:
            small += block
        elif block <= MIN_LARGE_ALLOC:
            medium += block
        else:
            large += _round_up(block, ROUND_LARGE)
    return _round_up(small, SMALL_SEGMENT) + _round_up(medium, LARGE_SEGMENT) + large

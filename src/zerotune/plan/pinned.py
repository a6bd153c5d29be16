"""What torch's pinned (page-locked) host allocator holds for the buffers DeepSpeed pins under CPU offload.

DeepSpeed 0.19.8 pins through torch by default: accelerator/abstract_accelerator.py `pin_memory` ->
`tensor.pin_memory()`, served by torch's CUDA caching host allocator (ATen/core/CachingHostAllocator.h). That
allocator hands out power-of-two blocks and keeps a freed block pinned in its free list, so a process's resident
set holds the rounded blocks, not the tensors' bytes: a 9,794 MiB fp32 partition takes 16,384 MiB.

A plan's terms for this are named with PINNED_ROUNDING (what a live pinned buffer's block holds beyond its tensor)
or PINNED_CACHE (freed pinned blocks the allocator keeps): host.py leaves both out on a CPU accelerator, where
DeepSpeed's `pin_memory` returns the tensor as it is (accelerator/cpu_accelerator.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

PINNED_ROUNDING = "_pinned_rounding"  # name suffix: a live pinned buffer's block beyond its tensor's bytes
PINNED_CACHE = "_pinned_cache"        # name suffix: freed pinned blocks kept in the allocator's free list


def pinned_block_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator holds for one pinned tensor of `nbytes`: the next power of two.

    torch/include/ATen/core/CachingHostAllocator.h lines 300-305 (`allocate`): the request is rounded with
    `c10::llvm::PowerOf2Ceil(size)` while `size <= pinned_max_round_threshold()`, whose default is SIZE_MAX
    (c10/core/AllocatorConfig.h line 361, `pinned_max_round_threshold_`), so every size is rounded; a power of
    two stays as it is, and an empty request takes nothing. `free` (line 352) puts the block back in the free
    list of its size, still pinned, for a later request of that size."""
    if nbytes <= 0:
        return 0
    return 1 << (int(nbytes) - 1).bit_length()


def rounding_bytes(sizes: Iterable[int]) -> int:
    """What the blocks of separately pinned tensors of `sizes` (bytes) hold beyond the tensors themselves."""
    return sum(pinned_block_bytes(n) - n for n in sizes)


def torch_pins() -> bool:
    """Whether DeepSpeed pins through torch's allocator, its default. DS_PIN_MEMORY_BACKEND=native pins with its
    own op instead (utils/pin_memory.py NativePinnedMemory: mlock'd at the tensor's exact size, freed with the
    tensor), which neither rounds nor caches. Read from this process's environment, which the workers inherit."""
    return os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() != "native"

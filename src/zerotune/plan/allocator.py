"""torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) by its rules, no fitted factor: what live
tensors reserve (what nvidia-smi counts) beyond their bytes, a replay of allocations and frees (CachingAllocator;
TaggedPool and storage_mode for zero3_replay.py), and what a CUDA process holds before its first tensor."""

from __future__ import annotations

import bisect
import functools
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from zerotune.config.schema import MIB

MIN_BLOCK = 512
SMALL_SIZE, SMALL_SEGMENT = 1 << 20, 2 << 20
MIN_LARGE_ALLOC, LARGE_SEGMENT, ROUND_LARGE = 10 << 20, 20 << 20, 2 << 20


def _round_up(n: int, to: int) -> int:
    return int(math.ceil(n / to) * to) if n else 0


def reserved_bytes(sizes: Iterable[int]) -> int:
    """Bytes the allocator reserves to hold tensors of these sizes (bytes) alive at once, packing taken as
    perfect: the least it can reserve."""
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


def block_size(nbytes: int) -> int:
    """round_size: the block a request of `nbytes` gets (0 for none: torch allocates nothing for 0 bytes)."""
    return max(MIN_BLOCK, _round_up(int(nbytes), MIN_BLOCK)) if nbytes > 0 else 0


def segment_size(block: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd when no cached block fits a block of this size."""
    if block <= SMALL_SIZE:
        return SMALL_SEGMENT
    if block < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return _round_up(block, ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    bid: int
    addr: int
    size: int
    small: bool
    segment: int
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocator:
    """The allocator's rules, replayed (defaults: no PYTORCH_CUDA_ALLOC_CONF, one stream):
    - blocks rounded up to 512 B; blocks up to 1 MiB cut from 2 MiB segments (small pool); larger ones from
      20 MiB segments under 10 MiB, else a segment of their own rounded up to 2 MiB (get_allocation_size);
    - a request takes the smallest cached block of its pool that fits, split when the rest is over 1 MiB (large
      pool) or at least 512 B (small), keeping the front (should_split);
    - a freed block merges with free neighbours and stays reserved; empty_cache() returns whole segments only.
    Segments come at increasing addresses (cudaMalloc's are unknown), which only breaks ties in size.
    `allocated`/`reserved`: torch's memory_allocated()/memory_reserved(); `peak_*` their maxima since the start
    or `reset_peaks()` (torch.cuda.reset_peak_memory_stats)."""

    def __init__(self) -> None:
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # (size, addr, block id)
        self._blocks: dict[int, _Block] = {}    # every block, allocated or free, by id
        self._live: dict[int, _Block] = {}      # handle -> its block
        self._next_id = self._next_handle = 1
        self._next_addr = 0
        self.segments: dict[int, int] = {}      # segment (its first address) -> bytes
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _block(self, addr: int, size: int, small: bool, segment: int) -> _Block:
        block = _Block(self._next_id, addr, size, small, segment)
        self._blocks[block.bid], self._next_id = block, self._next_id + 1
        return block

    def _cache(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr, block.bid))

    def _uncache(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.addr, block.bid))]

    def malloc(self, nbytes: int) -> int:
        """A block for `nbytes`: the smallest cached one of its pool that fits (split if the rest is worth
        keeping), else a new segment. Returns a handle for `free` (0 for a 0-byte request: nothing allocated)."""
        size = block_size(nbytes)
        if not size:
            return 0
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = self._blocks[pool.pop(i)[2]]
        else:  # cudaMalloc a new segment (get_allocation_size)
            seg = segment_size(size)
            block = self._block(self._next_addr, seg, small, self._next_addr)
            self.segments[block.addr] = seg
            self._next_addr += seg
            self.reserved += seg
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):  # should_split: the block keeps the front
            remainder = self._block(block.addr + size, rest, small, block.segment)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next, block.size = remainder, size
            self._cache(remainder)
        block.allocated = True
        self.allocated += block.size
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._live[handle] = block
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return handle

    def free(self, handle: int) -> None:
        """Give a block back: it merges with the free blocks beside it in its segment and stays reserved."""
        if not handle:
            return
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        before, after = block.prev, block.next
        if after is not None and not after.allocated:  # absorb the free block after it
            self._uncache(after)
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
            del self._blocks[after.bid]
        if before is not None and not before.allocated:  # the free block before absorbs it
            self._uncache(before)
            before.size += block.size
            before.next = block.next
            if block.next is not None:
                block.next.prev = before
            del self._blocks[block.bid]
            block = before
        self._cache(block)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every free block that is a whole segment goes back to the driver."""
        for small, pool in self._free.items():
            keep = []
            for size, addr, bid in pool:
                block = self._blocks[bid]
                if block.prev is None and block.next is None:
                    self.reserved -= size
                    del self.segments[block.segment], self._blocks[bid]
                else:
                    keep.append((size, addr, bid))
            self._free[small] = keep

    def size_of(self, handle: int) -> int:
        """The bytes of a live block (its request rounded as above)."""
        return self._live[handle].size

    def free_blocks(self) -> list[int]:
        """The sizes of the cached (free) blocks, smallest first."""
        return sorted(size for pool in self._free.values() for size, _, _ in pool)


def replay(events: Iterable[tuple]) -> CachingAllocator:
    """`events` through a fresh CachingAllocator, returned: ("alloc", key, nbytes), ("free", key), ("empty_cache",),
    ("reset_peaks",). For a phase whose order of allocations is known: what frees leave reserved counts too."""
    allocator, blocks = CachingAllocator(), {}
    for event in events:
        if event[0] == "alloc":
            blocks[event[1]] = allocator.malloc(event[2])
        elif event[0] == "free":
            allocator.free(blocks.pop(event[1]))
        elif event[0] == "empty_cache":
            allocator.empty_cache()
        elif event[0] == "reset_peaks":
            allocator.reset_peaks()
        else:
            raise ValueError(f"unknown allocator event {event!r}")
    return allocator


class TaggedPool:
    """CachingAllocator with a tag per live block: what each is, and the tags' totals at the peaks."""

    def __init__(self) -> None:
        self.sim = CachingAllocator()
        self.tags: dict[int, tuple[str, int]] = {}
        self.totals: dict[str, int] = {}
        self.tag, self.phase = "activations", "loading"
        self.reset()

    def reset(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): the peaks restart from what is held now (`carried`)."""
        self.sim.reset_peaks()
        self.at_allocated = self.at_reserved = ("carried", dict(self.totals), self.sim.reserved)
        self._snapshot = (self.sim.reserved, self.sim.allocated)

    def malloc(self, nbytes: int, tag: str | None = None) -> int:
        handle = self.sim.malloc(int(nbytes))
        if handle:
            name, size = tag or self.tag, self.sim.size_of(handle)
            self.tags[handle] = (name, size)
            self.totals[name] = self.totals.get(name, 0) + size
            if self.sim.allocated >= self.sim.peak_allocated:
                self.at_allocated = (self.phase, dict(self.totals), self.sim.reserved)
            # nvidia-smi's peak: the most allocated while the reserve is at its largest (it never shrinks here)
            if (self.sim.reserved, self.sim.allocated) >= self._snapshot:
                self.at_reserved = (self.phase, dict(self.totals), self.sim.reserved)
                self._snapshot = (self.sim.reserved, self.sim.allocated)
        return handle

    def free(self, handle: int) -> None:
        if handle in self.tags:
            name, size = self.tags.pop(handle)
            self.totals[name] -= size
            self.sim.free(handle)

    def retag(self, handle: int | None, tag: str) -> None:
        if handle in self.tags:
            name, size = self.tags[handle]
            self.totals[name] -= size
            self.totals[tag] = self.totals.get(tag, 0) + size
            self.tags[handle] = (tag, size)

    def record(self) -> dict:
        """This step's (or loading's) peaks and what made them up, in bytes."""
        def parts(at: tuple[str, dict, int]) -> dict:
            phase, totals, reserved = at
            kept = {k: v for k, v in totals.items() if v}
            return {"phase": phase, "tags": kept, "cached": reserved - sum(kept.values())}
        return {"allocated": self.sim.peak_allocated, "reserved": self.sim.peak_reserved,
                "at_allocated_peak": parts(self.at_allocated), "at_reserved_peak": parts(self.at_reserved)}


def storage_mode(pool: TaggedPool):
    """A torch dispatch mode: every new storage an op returns is a block of the pool, freed with its storage
    (a weak reference's callback, as torch's MemTracker follows storages)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class Storages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = WeakIdKeyDictionary()
            self.refs: dict[int, weakref.ref] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
            return out

        def track(self, t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            handle = self.seen.get(storage)
            if handle is None:
                handle = self.seen[storage] = pool.malloc(storage.nbytes())
                if handle:
                    self.refs[handle] = weakref.ref(storage, functools.partial(self.gone, handle))
            return handle

        def gone(self, handle: int, _ref: object = None) -> None:
            self.refs.pop(handle, None)
            pool.free(handle)

        def ignore(self, t: torch.Tensor) -> None:
            """A storage the pool accounts for itself (a partition, the bucket): never a block of its own."""
            self.seen[t.untyped_storage()] = 0

        def handle(self, t: torch.Tensor) -> int | None:
            return self.seen.get(t.untyped_storage())

    return Storages()


# Before the first tensor: the context (lazy kernel loading since CUDA 11.7 keeps it to a few hundred MiB)
# and cuBLAS's workspace, per device family (experiments/results/planner_reference.md).
CONTEXT: dict[str, dict] = {
    "ampere": {"bytes": 256 * MIB, "source": "RTX 3090, torch 2.7 (invoke-ai/InvokeAI#9413: a bare context, 256 MiB)"},
    "ada": {"bytes": 426 * MIB, "source": "RTX 6000 Ada, the 4090's chip (unslothai/unsloth-zoo PR #1053: 426 MiB)"},
    # Measured, and more than a bare context: what a DeepSpeed training process holds outside torch's allocator
    # (the context, NCCL's buffers, the kernels it loaded), which is what nvidia-smi adds to torch's figures.
    "hopper": {"bytes": 1324 * MIB, "source": "measured: nvidia-smi's process peak less torch's reserved peak, "
                                              "1,320-1,328 MiB in 12 DeepSpeed runs on an H100 and an H200 (torch "
                                              "2.11+cu130, NCCL 2.28; experiments/results/gpu/)"},
}

# cuBLAS workspace per handle (one per device and stream in use), allocated through torch's allocator:
# torch CublasHandlePool.cpp getChosenWorkspaceSize ":4096:2:16:8" = 8.125 MiB, 32 MiB from Hopper on;
# cuBLASLt adds 1 MiB (CUDABlas.cpp).
CUBLAS_WORKSPACE: dict[str, int] = {"ampere": int(8.125 * MIB) + MIB, "ada": int(8.125 * MIB) + MIB,
                                    "hopper": 32 * MIB + MIB}

"""The host memory a node's ranks need at their peak, from a prediction (predict.py).

On a CPU accelerator the device's memory is host memory: each rank holds what the plan puts "on the GPU"
(less what only CUDA has: its context, cuBLAS's workspace, the caching allocator's rounding) beside what it
puts on the host. Elsewhere the host holds the host terms alone, some of which only a run on a card has: what
torch's pinned allocator adds to DeepSpeed's pinned buffers (pinned.py), and the module's host copies that
glibc's heap keeps after they move to the card (`heap_kept_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

from zerotune.plan.pinned import PINNED_CACHE, PINNED_ROUNDING
from zerotune.rundir.plan import Plan, at_peak
from zerotune.units import MIB

CUDA_ONLY = ("cuda_context", "cublas_workspace", "allocator_rounding")
MODEL_LOAD = "model_load"
# The parameters' host copies that DeepSpeed's cast made and its move to the card freed, still in glibc's heap
HEAP_KEPT = "module_cast_heap_kept"
# glibc malloc/malloc.c DEFAULT_MMAP_THRESHOLD_MAX (4 * 1024 * 1024 * sizeof(long) on 64-bit): free() raises
# the mmap threshold to the size of each mmapped chunk it frees, up to this; smaller requests come from the heap.
MMAP_THRESHOLD_MAX = 32 * MIB
# Model states and DeepSpeed's buffers: what ZeRO stages, offload and adapters change.
STATE_TERMS = ("params", "params_persistent", "grads", "master_weights", "optimizer_states", "ema")


def cuda_only(name: str) -> bool:
    """Whether a term exists only where the run trains on a CUDA card: its context, cuBLAS's workspace and the
    caching allocator's rounding on the card; on the host, torch's pinned blocks beyond DeepSpeed's buffers
    (pinned.py: a CPU accelerator pins nothing) and the heap glibc keeps after the module moves to the card
    (on a CPU the module never moves: its parameters are the `params` term)."""
    bare = name.removeprefix("deepspeed:")
    return name in CUDA_ONLY or bare.endswith((PINNED_ROUNDING, PINNED_CACHE)) or bare == HEAP_KEPT


def heap_kept_bytes(sizes: Iterable[int]) -> int:
    """Bytes of host tensors of `sizes` (allocated in turn, then all freed) that the process still holds: those
    glibc's malloc served from its heap, every one under the mmap threshold's ceiling (MMAP_THRESHOLD_MAX). A
    request at or above the threshold is mmapped, and unmapped when freed; the threshold starts at 128 KiB and
    free() raises it to the size of each mmapped chunk it frees, so once a few of a model's larger tensors have
    been freed it stands near its ceiling and the smaller tensors come from the heap. free() gives heap memory
    back only from the heap's top, above which later small allocations (the new tensors' own records) sit: the
    rest stays resident, free for later requests. Measured on this planner's host (glibc 2.36, torch 2.13):
    SDXL's U-Net built in fp32 (mmapped, 9,625 MiB), each parameter cast to bf16 as DeepSpeed's engine does, the
    module then moved off the host: the heap grew by 4,770 MiB and kept it (mallinfo2: 4,770 MiB free in the
    heap, none given back), against 4,742 MiB of bf16 parameters under 32 MiB."""
    return sum(int(n) for n in sizes if 0 < n < MMAP_THRESHOLD_MAX)


def rank_terms(found: Plan, accelerator: str) -> dict[str, float]:
    """{term: MiB} one rank holds in host memory at its training peak (the fp32 build, before, is apart)."""
    terms: dict[str, float] = {}
    if found.device == "cpu":  # --device cpu: one pool already, at the step's largest moment
        held = at_peak(found.step_terms, found.step_peak_moment)
    else:
        device = found.gpu_terms if accelerator == "cpu" else ()
        held = [*at_peak(device, found.step_peak_moment), *found.host_terms]
    on_cpu = accelerator == "cpu" or found.device == "cpu"  # where nothing is pinned and the module stays
    for term in held:
        if term.term in CUDA_ONLY or term.term == MODEL_LOAD or (on_cpu and cuda_only(term.term)):
            continue
        terms[term.term] = terms.get(term.term, 0.0) + (term.mib or 0.0)
    return terms


def node_need_mib(found: Plan, ranks: int, accelerator: str) -> float | None:
    """The host memory this node's `ranks` need at their peak: each holds its terms, or its build of the U-Net,
    which comes first, whichever is larger (the whole model in fp32 below ZeRO-3; at ZeRO-3, built under
    zero.Init, the rank's partition: plan/predict.py's `model_load`). None when the plan has no terms."""
    if "host_terms" not in found:
        return None
    load = sum(t.mib or 0.0 for t in found.host_terms if t.term == MODEL_LOAD)
    return ranks * max(load, sum(rank_terms(found, accelerator).values()))


def largest_share(plan: Plan, accelerator: str) -> tuple[float, float]:
    """(model states and DeepSpeed's buffers, activations) as shares of one rank's terms, each 0..1."""
    terms = rank_terms(plan, accelerator)
    total = sum(terms.values()) or 1.0
    states = sum(mib for name, mib in terms.items() if name in STATE_TERMS or name.startswith("deepspeed:"))
    return states / total, terms.get("activations", 0.0) / total

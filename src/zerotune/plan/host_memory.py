"""Host memory: the blocks torch's pinned allocator holds for DeepSpeed's pinned buffers, the heap glibc keeps of
the module's host copies, each rank's host terms, and the node's predicted peak RSS, parent + ranks × (import
baseline + tensors), as the job's memory sampler measures the workers' process tree."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable

from zerotune.config import files
from zerotune.config.schema import MIB
from zerotune.rundir.plan import Plan, ProcessPrediction, Term, at_peak, mib_of

PINNED_ROUNDING = "_pinned_rounding"  # name suffix: a live pinned buffer's block beyond its tensor's bytes
PINNED_CACHE = "_pinned_cache"        # name suffix: freed pinned blocks kept in the allocator's free list


def pinned_block_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator (DeepSpeed's default pinning) holds for one pinned tensor of
    `nbytes`: the next power of two (CachingHostAllocator.h `allocate`, lines 300-305: PowerOf2Ceil up to
    pinned_max_round_threshold, SIZE_MAX by default), so a 9,794 MiB fp32 partition takes 16,384 MiB. A freed
    block stays pinned in its size's free list (line 352)."""
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
    """Whether a term exists only where the run trains on a CUDA card: the context, cuBLAS's workspace, the
    allocator's rounding, torch's pinned blocks (a CPU accelerator pins nothing) and glibc's kept heap (on a CPU
    the module never moves)."""
    bare = name.removeprefix("deepspeed:")
    return name in CUDA_ONLY or bare.endswith((PINNED_ROUNDING, PINNED_CACHE)) or bare == HEAP_KEPT


def heap_kept_bytes(sizes: Iterable[int]) -> int:
    """Bytes of host tensors of `sizes` (allocated in turn, then all freed) the process still holds: those under
    MMAP_THRESHOLD_MAX, served from glibc's heap (free() has raised the threshold near that ceiling once a few
    large tensors went), which free() gives back only from its top. Measured here (glibc 2.36, torch 2.13): SDXL's
    fp32 U-Net cast to bf16 as DeepSpeed does, then moved off the host, left 4,770 MiB in the heap, against
    4,742 MiB of bf16 parameters under 32 MiB."""
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


PROCESS_RSS = "process_rss"   # plan["host_peak_kind"]: the host figure predicts the job tree's peak RSS
CACHE_FILE = "process_baseline_v2.json"
# What a worker imports before it builds the model (job/bootstrap.py, job/worker.py, train/run.py),
# and torch's inductor, which it loads while DeepSpeed builds its engine (in a worker's sys.modules after its
# first step; of the ~2,000 modules loaded then, the only one that adds tens of MiB: 43 MiB on this host).
WORKER_IMPORTS = ("torch", "deepspeed", "accelerate", "diffusers", "zerotune.job.worker",
                  "zerotune.train.trainer", "torch._inductor.compile_fx")
_VERSIONED = ("deepspeed", "accelerate", "diffusers")
MEASURE_TIMEOUT_S = 300
# The job process's share of the measured tree: 0, because the job's sampler leaves it out
# (job/parent.py: MemorySampler(include_root=False); torch's elastic agent runs inside the job process).
PARENT_BASELINE_MIB = 0.0
# A card's worker, before it builds the model, has made CUDA's context (the driver's host allocations) and, at
# its first matmul, loaded cuBLAS: pages a CPU-only host's baseline cannot have.
CUDA_START = "torch.cuda.init()\na = torch.ones(64, 64, device='cuda')\n(a @ a).sum().item()"
_STATUS = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB$", re.MULTILINE)


def baseline_key() -> str:
    """Host, Python, the imported packages' versions and the import list: a baseline is reused only where all
    of them match."""
    import torch

    # torch's build as it names itself (2.13.0+cpu, 2.13.0+cu130): PyPI's metadata says 2.13.0 for its CUDA
    # build, whose imports load other libraries (another figure)
    versions = [f"torch{torch.__version__}"]
    for name in _VERSIONED:
        try:
            versions.append(f"{name}{importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name}-absent")
    imports = hashlib.sha1(",".join(WORKER_IMPORTS).encode()).hexdigest()[:8]  # another list, another figure
    return "|".join([platform.node(), platform.machine(), f"python{platform.python_version()}", *versions,
                     f"imports-{imports}"])


def process_baseline_mib(on_card: bool = False) -> float | None:
    """A fresh worker's RSS (MiB) after its imports: measured once, cached; None where the child failed. `on_card`:
    with CUDA's context and cuBLAS loaded too (CUDA_START); None where this host has no usable card."""
    file = files.cache_dir("plan") / CACHE_FILE
    known = files.read_json(file)
    known = known if isinstance(known, dict) else {}
    key = baseline_key() + ("|cuda" if on_card else "")
    if isinstance(known.get(key), dict):
        return known[key]["rss_mib"]
    if on_card and not _card_here():
        return None
    measured = measure_imports(WORKER_IMPORTS, CUDA_START if on_card else "")
    if measured is not None:
        files.write_cached_json(file, {**known, key: measured})
    return None if measured is None else measured["rss_mib"]


def _card_here() -> bool:
    import torch

    return bool(torch.version.cuda) and torch.cuda.is_available()


def measure_imports(modules: tuple[str, ...], then: str = "") -> dict | None:
    """{"rss_mib", "hwm_mib"} of a child interpreter (this one's executable) that imported `modules` and ran
    `then`, read from its /proc/self/status; None where the child failed or the kernel has no such file."""
    code = "\n".join([*(f"import {m}" for m in modules), then, "print(open('/proc/self/status').read())"])
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    found = {name: int(kb) / 1024 for name, kb in _STATUS.findall(done.stdout)}
    if done.returncode != 0 or "VmRSS" not in found:
        return None
    return {"rss_mib": found["VmRSS"], "hwm_mib": found.get("VmHWM"), "modules": list(modules)}


def rank_tensors_mib(found: Plan, accelerator: str = "cpu") -> tuple[float | None, str]:
    """(MiB of tensors one rank holds at its peak, where the figure came from); None without terms.
    `accelerator`: where the rank trains, cpu (a GPU plan's device terms are host memory too) or cuda."""
    if found.device == "cpu" and isinstance(found.step_peak_mib, (int, float)):
        # the step's pool also holds the terms only a card's run has (host.py cuda_only): none on a CPU
        device_only = sum(t.mib or 0.0 for t in found.step_terms if cuda_only(t.term)
                          and t.held_in in ("persistent", found.step_peak_moment))
        step, source = float(found.step_peak_mib) - device_only, "plan step_peak_mib (CPU plan: the whole step's peak)"
    elif "host_terms" in found:
        step, source = sum(rank_terms(found, accelerator).values()), f"sum of host.py rank_terms ({accelerator})"
    else:
        return None, "no terms in the plan"
    load = sum(t.mib or 0.0 for t in found.host_terms if t.term == MODEL_LOAD)
    if load > step:
        return load, f"{MODEL_LOAD} (the fp32 build at load time, above the step's {step:,.0f} MiB)"
    return step, source


def node_rss_prediction(plan: Plan, ranks: int, baseline: float | None, parent: float | None,
                        accelerator: str = "cpu", baseline_note: str = "") -> ProcessPrediction:
    """The node's predicted peak RSS, parent + ranks × (baseline + tensors); its `mib` is None where the baseline,
    the parent or the tensors are unknown (never a guess)."""
    tensors, tensor_source = rank_tensors_mib(plan, accelerator)
    terms = (
        Term("parent_process", parent, "the job process: outside the sampled tree"),
        Term("process_baseline", None if baseline is None else ranks * baseline,
             f"{ranks} rank(s) × a fresh worker's RSS after its imports (measured on this host{baseline_note})"),
        Term("rank_tensors", None if tensors is None else ranks * tensors, f"{ranks} rank(s) × {tensor_source}"),
    )
    mib = None if any(t.mib is None for t in terms) else mib_of(terms)
    return ProcessPrediction(mib, terms, "process RSS: parent + ranks × (import baseline + tensors)")


def mark_process_prediction(plan: Plan, node_prediction: ProcessPrediction) -> Plan:
    """The plan with its host figure made the process-RSS prediction (what a run's summary measures); the terms
    are kept either way, and an unknown prediction (mib None) leaves the figure as it was, unmarked."""
    plan = plan.adding(host_process_terms=node_prediction)
    if node_prediction.mib is not None:
        plan = plan.adding(host_peak_mib=node_prediction.mib, host_peak_kind=PROCESS_RSS)
    return plan


def card_process_prediction(plan: Plan, ranks: int) -> Plan:
    """A card's plan with its host figure made the process-RSS prediction of the node's `ranks` workers, each
    its host terms alone (rank_terms on a CUDA accelerator) on a baseline with CUDA's context where measurable."""
    on_card = process_baseline_mib(on_card=True)
    baseline: float | None
    if on_card is not None:
        baseline, note = on_card, ", on its card: CUDA's context and cuBLAS loaded"
    else:  # the figure stands without them, and says what it lacks
        baseline, note = process_baseline_mib(), (": no card here, so without the CUDA context's host memory "
                                                  "and the CUDA libraries a card's worker maps (unmeasured)")
    node = node_rss_prediction(plan, ranks, baseline, PARENT_BASELINE_MIB, "cuda", note)
    return mark_process_prediction(plan, node)

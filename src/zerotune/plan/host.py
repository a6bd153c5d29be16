"""The host memory a node's ranks need at their peak, from a prediction (predict.py).

On a CPU accelerator the device's memory is host memory: each rank holds what the plan puts "on the GPU"
(less what only CUDA has: its context, cuBLAS's workspace, the caching allocator's rounding) beside what it
puts on the host. Elsewhere the host holds the host terms alone.
"""

from __future__ import annotations

from zerotune.rundir.plan import Plan, at_peak

CUDA_ONLY = ("cuda_context", "cublas_workspace", "allocator_rounding")
MODEL_LOAD = "model_load"
# Model states and DeepSpeed's buffers: what ZeRO stages, offload and adapters change.
STATE_TERMS = ("params", "params_persistent", "grads", "master_weights", "optimizer_states", "ema")


def rank_terms(plan: dict, accelerator: str) -> dict[str, float]:
    """{term: MiB} one rank holds in host memory at its training peak (the fp32 build, before, is apart)."""
    found = Plan.from_dict(plan) or Plan()
    terms: dict[str, float] = {}
    if found.device == "cpu":  # --device cpu: one pool already, at the step's largest moment
        held = at_peak(found.step_terms, found.step_peak_moment)
    else:
        device = found.gpu_terms if accelerator == "cpu" else ()
        held = [*at_peak(device, found.step_peak_moment), *found.host_terms]
    for term in held:
        if term.term in CUDA_ONLY or term.term == MODEL_LOAD:
            continue
        terms[term.term] = terms.get(term.term, 0.0) + (term.mib or 0.0)
    return terms


def node_need_mib(plan: dict, ranks: int, accelerator: str) -> float | None:
    """The host memory this node's `ranks` need at their peak: each holds its terms, or its build of the U-Net,
    which comes first, whichever is larger (the whole model in fp32 below ZeRO-3; at ZeRO-3, built under
    zero.Init, the rank's partition: plan/predict.py's `model_load`). None when the plan has no terms."""
    found = Plan.from_dict(plan) or Plan()
    if "host_terms" not in found:
        return None
    load = sum(t.mib or 0.0 for t in found.host_terms if t.term == MODEL_LOAD)
    return ranks * max(load, sum(rank_terms(plan, accelerator).values()))


def largest_share(plan: dict, accelerator: str) -> tuple[float, float]:
    """(model states and DeepSpeed's buffers, activations) as shares of one rank's terms, each 0..1."""
    terms = rank_terms(plan, accelerator)
    total = sum(terms.values()) or 1.0
    states = sum(mib for name, mib in terms.items() if name in STATE_TERMS or name.startswith("deepspeed:"))
    return states / total, terms.get("activations", 0.0) / total

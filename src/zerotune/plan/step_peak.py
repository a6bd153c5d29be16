"""The whole training step's peak, moment by moment: forward and backward, the gradient reduction that ends
backward, and the optimizer's step (its gradients flattened and cast, then the update). What is held
throughout (model states, DeepSpeed's persistent buffers) is counted once; each moment adds what lives only
then; the step's peak is the largest moment.

Checked on this CPU against what torch really allocates for a whole step through zerotune's own trainer
(benchmarks/bench_plan_step.py; DeepSpeed 0.19.8, one rank). What differs on a CUDA card is decided here by
`device`, each branch with its source: torch's optimizers run their foreach kernels on CUDA tensors and one
tensor at a time on CPU ones (torch/optim/optimizer.py:_default_to_fused_or_foreach), and DeepSpeed wraps
FusedAdam (CUDA) in FP16_Optimizer but torch's AdamW (zerotune's choice on a CPU) in FP16_UnfusedOptimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
MOMENTS = ("forward+backward", "reduce", "step:flatten", "step:update")


@dataclass(frozen=True)
class StepShape:
    """What decides the step's transients."""

    stage: int
    use_deepspeed: bool
    optimizer: str           # model_states' OptimizerKind.name: torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam, ...
    param_elem: int          # bytes per element: parameters (and their gradients), master weights
    master_elem: int
    offloaded: bool          # the optimizer's states on the host (or NVMe)
    trained: int             # elements the optimizer updates on this rank
    largest_trained: int     # the largest tensor it steps at once: a parameter, the flat partition, a sub-group
    device: str              # cuda | cpu


def moment_of(term: dict) -> str:
    return term.get("moment", "persistent")


def step_peak(terms: list[dict]) -> tuple[float, str]:
    """(MiB, moment): the persistent terms plus the largest moment's."""
    base = sum(t["mib"] for t in terms if moment_of(t) == "persistent")
    moments = {m: sum(t["mib"] for t in terms if moment_of(t) == m) for m in MOMENTS}
    worst = max(MOMENTS, key=lambda m: moments[m])
    return base + moments[worst], worst


def terms_at_peak(terms: list[dict], moment: str) -> list[dict]:
    """The terms that make up the peak at `moment`: those held throughout and that moment's own."""
    return [t for t in terms if moment_of(t) in ("persistent", moment)]


def gradient_terms(shape: StepShape, grads_bytes: int, trace) -> list[dict]:
    """The gradients and the activations, as each stage holds them."""
    deepspeed = shape.use_deepspeed
    if not deepspeed or shape.stage == 0:  # param.grad: through backward, its reduction and the whole step
        return [_t("activations_and_grads", trace.activation_and_grad_peak_bytes, "forward+backward", _JOINT),
                *(_t("grads", grads_bytes, m, "param.grad") for m in ("reduce", "step:flatten", "step:update"))]
    if shape.offloaded or shape.stage == 3:  # reduced into pinned host buffers, or ZeRO-3's flat partition
        return [_t("activations", trace.activation_peak_bytes, "forward+backward", _TRACE)]
    if shape.stage == 1:  # kept in param.grad until the step flattens them
        return [_t("activations_and_grads", trace.activation_and_grad_peak_bytes, "forward+backward", _JOINT),
                _t("grads", grads_bytes, "step:flatten", "param.grad until the step flattens them")]
    return [_t("activations", trace.activation_peak_bytes, "forward+backward", _TRACE),  # ZeRO-2: the partition
            *(_t("grads", grads_bytes, m, "the gradient partition") for m in ("forward+backward", "step:flatten"))]


def step_transients(shape: StepShape) -> list[dict]:
    """What the optimizer's step allocates and frees beyond the model states and DeepSpeed's step buffers."""
    terms = []
    if shape.use_deepspeed and shape.stage == 0 and shape.param_elem != shape.master_elem:
        terms += _stage0_fp32_grads(shape)
    if shape.use_deepspeed and shape.stage in (1, 2) and not shape.offloaded:
        terms += _zero12_flatten(shape)
    if shape.use_deepspeed and shape.stage == 3 and not shape.offloaded:
        terms.append(_t("step_fp32_grad_sub_group", shape.largest_trained * shape.master_elem, "step:update",
                        _STAGE3 + "_prepare_fp32_grad_for_sub_group (the sub-group's fp32 gradient)"))
    return terms + _optimizer_temporaries(shape)


def _stage0_fp32_grads(shape: StepShape) -> list[dict]:
    if shape.optimizer == "FusedAdam":  # the cast copies and their flat copy, then the flat one alone
        src = "runtime/fp16/fused_optimizer.py:FP16_Optimizer.step"
        return [_t("step_fp32_grads", shape.trained * 8, "step:flatten", src + ": every gradient cast to fp32 and "
                   "flattened (_flatten_dense_tensors), both held at once"),
                _t("step_fp32_grads", shape.trained * 4, "step:update", src + ": the flat fp32 gradients")]
    return [_t("step_fp32_grads", shape.trained * 4, "step:update",
               "runtime/fp16/unfused_optimizer.py:FP16_UnfusedOptimizer.step: an fp32 copy of every gradient")]


def _zero12_flatten(shape: StepShape) -> list[dict]:
    # DeepSpeedZeroOptimizer.step: flatten_dense_tensors_aligned(averaged_gradients), then .to(master dtype),
    # a copy only where the dtypes differ; the fp32 partition itself is buffers.py's step_fp32_grad_partition.
    src = "runtime/zero/stage_1_and_2.py:DeepSpeedZeroOptimizer.step"
    cast = shape.trained * shape.master_elem if shape.master_elem != shape.param_elem else 0
    return [_t("step_flat_grad_partition", shape.trained * shape.param_elem + cast, "step:flatten",
               src + " (the gradients flattened" + (", then cast" if cast else "") + ")")]


def _optimizer_temporaries(shape: StepShape) -> list[dict]:
    if not shape.optimizer.startswith("torch.optim."):
        return []  # FusedAdam/FusedLion (CUDA) and DeepSpeed's CPU ops update in place
    kind = shape.optimizer.rsplit(".", 1)[1]
    module = "adagrad" if kind == "Adagrad" else "adam"  # torch's AdamW is adam.py's Adam, decoupled
    per_tensor = {"AdamW": 2, "Adam": 2, "Adagrad": 1}.get(kind, 0)
    if not per_tensor:
        return []
    if shape.device == "cuda":  # foreach: one new tensor per optimized tensor, all at once
        return [_t("optimizer_temporaries", shape.trained * shape.master_elem, "step:update",
                   f"torch/optim/{module}.py ({kind}), foreach on CUDA tensors: torch._foreach_sqrt of the states")]
    what = "exp_avg_sq.sqrt() / bias_correction2_sqrt" if per_tensor == 2 else "state_sum.sqrt()"
    return [_t("optimizer_temporaries", per_tensor * shape.largest_trained * shape.master_elem, "step:update",
               f"torch/optim/{module}.py ({kind}), one tensor at a time on CPU tensors: {what} of the largest one")]


_TRACE = "fake-tensor trace of forward + backward"
_JOINT = _TRACE + ": activations and the gradients accumulated so far, at their joint peak"
_STAGE3 = "runtime/zero/stage3.py:DeepSpeedZeroOptimizer_Stage3."


def _t(name: str, nbytes: float, moment: str, note: str) -> dict:
    return {"term": name, "mib": nbytes / MIB, "note": note, "moment": moment}

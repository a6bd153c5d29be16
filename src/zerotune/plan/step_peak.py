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

from typing import TYPE_CHECKING

from zerotune.plan.rules import StepShape, term
from zerotune.plan.stages import rules_for

if TYPE_CHECKING:  # activations imports torch: the planner's callers that only read a plan need not
    from zerotune.plan.activations import Trace

MOMENTS = ("forward+backward", "reduce", "step:flatten", "step:update")
_TRACE = "fake-tensor trace of forward + backward"
_JOINT = _TRACE + ": activations and the gradients accumulated so far, at their joint peak"


def moment_of(found: dict) -> str:
    return found.get("moment", "persistent")


def step_peak(terms: list[dict]) -> tuple[float, str]:
    """(MiB, moment): the persistent terms plus the largest moment's."""
    base = sum(t["mib"] for t in terms if moment_of(t) == "persistent")
    moments = {m: sum(t["mib"] for t in terms if moment_of(t) == m) for m in MOMENTS}
    worst = max(MOMENTS, key=lambda m: moments[m])
    return base + moments[worst], worst


def terms_at_peak(terms: list[dict], moment: str) -> list[dict]:
    """The terms that make up the peak at `moment`: those held throughout and that moment's own."""
    return [t for t in terms if moment_of(t) in ("persistent", moment)]


def gradient_terms(shape: StepShape, grads_bytes: int, trace: Trace) -> list[dict]:
    """The gradients and the activations, as each stage holds them."""
    if not shape.use_deepspeed or shape.stage == 0:  # param.grad: through backward, its reduction and the whole step
        return [term("activations_and_grads", trace.activation_and_grad_peak_bytes, _JOINT, "forward+backward"),
                *(term("grads", grads_bytes, "param.grad", m) for m in ("reduce", "step:flatten", "step:update"))]
    if shape.offloaded or shape.stage == 3:  # reduced into pinned host buffers, or ZeRO-3's flat partition
        return [term("activations", trace.activation_peak_bytes, _TRACE, "forward+backward")]
    if shape.stage == 1:  # kept in param.grad until the step flattens them
        return [term("activations_and_grads", trace.activation_and_grad_peak_bytes, _JOINT, "forward+backward"),
                term("grads", grads_bytes, "param.grad until the step flattens them", "step:flatten")]
    return [term("activations", trace.activation_peak_bytes, _TRACE, "forward+backward"),  # ZeRO-2: the partition
            *(term("grads", grads_bytes, "the gradient partition", m) for m in ("forward+backward", "step:flatten"))]


def step_transients(shape: StepShape) -> list[dict]:
    """What the optimizer's step allocates and frees beyond the model states and DeepSpeed's step buffers, on the
    device (an offloaded optimizer's own temporaries are host memory: host_step_temporaries)."""
    stage = shape.stage if shape.use_deepspeed else 0
    own = [] if shape.offloaded else _optimizer_temporaries(shape, shape.device)
    return rules_for(stage).step_transients(shape) + own


def host_step_temporaries(shape: StepShape) -> list[dict]:
    """An offloaded optimizer steps the host partitions: what it allocates there while stepping."""
    return _optimizer_temporaries(shape, "cpu") if shape.offloaded else []


def _optimizer_temporaries(shape: StepShape, device: str) -> list[dict]:
    if shape.optimizer == "transformers.Adafactor":
        # Adafactor.step, one tensor at a time: `update` (grad**2 + eps) is alive while the second moment's
        # rsqrt (or the factors' product) makes the next one, and again while `-update` is added to the weights
        return [term("optimizer_temporaries", 2 * shape.largest_trained * 4,
                     "transformers/optimization.py Adafactor.step: two fp32 copies of the largest tensor it steps "
                     "(the flat partition under ZeRO)", "step:update")]
    if not shape.optimizer.startswith("torch.optim."):
        return []  # FusedAdam/FusedLion (CUDA), DeepSpeed's CPU ops and bitsandbytes' kernels update in place
    kind = shape.optimizer.rsplit(".", 1)[1]
    module = "adagrad" if kind == "Adagrad" else "adam"  # torch's AdamW is adam.py's Adam, decoupled
    per_tensor = {"AdamW": 2, "Adam": 2, "Adagrad": 1}.get(kind, 0)
    if not per_tensor:
        return []
    if device == "cuda":  # foreach: one new tensor per optimized tensor, all at once
        return [term("optimizer_temporaries", shape.trained * shape.master_elem,
                     f"torch/optim/{module}.py ({kind}), foreach on CUDA tensors: torch._foreach_sqrt of the states",
                     "step:update")]
    what = "exp_avg_sq.sqrt() / bias_correction2_sqrt" if per_tensor == 2 else "state_sum.sqrt()"
    return [term("optimizer_temporaries", per_tensor * shape.largest_trained * shape.master_elem,
                 f"torch/optim/{module}.py ({kind}), one tensor at a time on CPU tensors: {what} of the largest one",
                 "step:update")]


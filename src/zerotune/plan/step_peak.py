"""The whole training step's peak, moment by moment: forward and backward, the gradient reduction that ends
backward, and the optimizer's step (its gradients flattened and cast, then the update). What is held
throughout (model states, DeepSpeed's persistent buffers) is counted once; each moment adds what lives only
then; the step's peak is the largest moment.

Checked on this CPU against what torch really allocates for a whole step through zerotune's own trainer
(benchmarks/bench_plan_step.py; DeepSpeed 0.19.8, one rank). What differs on a CUDA card is decided here by
`device`, each branch with its source: torch's optimizers run their foreach kernels on CUDA tensors and one
tensor at a time on CPU ones (torch/optim/optimizer.py:_default_to_fused_or_foreach), and DeepSpeed wraps
FusedAdam (CUDA) in FP16_Optimizer but torch's AdamW (zerotune's choice on a CPU) in FP16_UnfusedOptimizer.

Plain accelerate (no DeepSpeed) trains fp32 weights under autocast: its forward and backward are traced as it runs
them (activations.plain_trace), where the half-precision weight copies autocast makes live beside the activations
and the fp32 gradients grow through backward, which is where such a step peaks when its activations are large
(not the optimizer's step). Under gradient accumulation the later micro-steps run their forward and backward with
the earlier ones' gradients held (ACCUMULATING; the gradients are buffers.py's term).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from zerotune.plan.rules import StepShape, optimizer_temporaries, term
from zerotune.plan.stage0 import ACCUMULATING
from zerotune.plan.stages import rules_for
from zerotune.rundir.plan import PERSISTENT, Term, mib_of

if TYPE_CHECKING:  # activations imports torch: the planner's callers that only read a plan need not
    from zerotune.plan.activations import Trace

MOMENTS = ("forward+backward", ACCUMULATING, "reduce", "step:flatten", "step:update")
_TRACE = "fake-tensor trace of forward + backward"
_JOINT = _TRACE + ": activations and the gradients accumulated so far, at their joint peak"
_PLAIN = (_TRACE + " as plain accelerate runs it (fp32 weights and inputs; the forward under torch.autocast, "
          "accelerate/accelerator.py Accelerator.prepare_model; {policy})")
_COPIES = ("torch autocast's half-precision copies of the fp32 weights (ATen/autocast_mode.cpp cached_cast: cached "
           "from a weight's first use in the forward to the autocast's exit at the forward's end, "
           "torch.clear_autocast_cache; then held by the backward nodes that saved them until each runs), alive {when}")


def step_peak(terms: Sequence[Term]) -> tuple[float, str]:
    """(MiB, moment): the persistent terms plus the largest moment's."""
    base = mib_of(t for t in terms if t.held_in == PERSISTENT)
    moments = {m: mib_of(t for t in terms if t.held_in == m) for m in MOMENTS}
    worst = max(MOMENTS, key=lambda m: moments[m])
    return base + moments[worst], worst


def gradient_terms(shape: StepShape, grads_bytes: int, trace: Trace) -> list[Term]:
    """The gradients and the activations, as each stage holds them."""
    if not shape.use_deepspeed:
        return _plain_gradient_terms(shape, grads_bytes, trace)
    if shape.stage == 0:  # param.grad: through backward, its reduction and the whole step
        return [term("activations_and_grads", trace.activation_and_grad_peak_bytes, _JOINT, "forward+backward"),
                *(term("grads", grads_bytes, "param.grad", m) for m in ("reduce", "step:flatten", "step:update"))]
    if shape.offloaded or shape.stage == 3:  # reduced into pinned host buffers, or ZeRO-3's flat partition
        return [term("activations", trace.activation_peak_bytes, _TRACE, "forward+backward")]
    if shape.stage == 1:  # kept in param.grad until the step flattens them
        return [term("activations_and_grads", trace.activation_and_grad_peak_bytes, _JOINT, "forward+backward"),
                term("grads", grads_bytes, "param.grad until the step flattens them", "step:flatten")]
    # ZeRO-2: the gradient partition, filled at each flush of the reduce bucket (during backward, or once after it)
    filled = "reduce" if shape.one_flush else "forward+backward"
    return [term("activations", trace.activation_peak_bytes, _TRACE, "forward+backward"),
            *(term("grads", grads_bytes, "the gradient partition", m) for m in (filled, "step:flatten"))]


def _plain_gradient_terms(shape: StepShape, grads_bytes: int, trace: Trace) -> list[Term]:
    """Plain accelerate: the step traced as it runs (fp32 weights, autocast's forward, fp32 gradients in param.grad
    through backward and the optimizer's step). The first micro-step peaks with the gradients growing; a later one
    (ACCUMULATING) holds all of them from the start, beside its activations."""
    from zerotune.plan.activations import plain_trace  # imports torch: only where a plan is made

    run = plain_trace(trace, shape.device)
    policy = {"cuda": "CUDA's cast policy, torch's ATen/autocast_mode.h",
              "cpu": "CPU's cast policy"}[shape.device] if run is not trace else "fp32: no autocast"
    joint, alone = run.weight_copies_at_joint_peak_bytes, run.weight_copies_at_activation_peak_bytes
    terms = [term("activations_and_grads", run.activation_and_grad_peak_bytes - joint, _PLAIN.format(policy=policy) +
                  ": activations and the fp32 gradients accumulated so far, at their joint peak", "forward+backward"),
             term("activations", run.activation_peak_bytes - alone, _PLAIN.format(policy=policy) +
                  ": a later micro-step's activations (under gradient accumulation)", ACCUMULATING)]
    if run is not trace:
        terms += [term("autocast_weight_copies", joint, _COPIES.format(when="at that joint peak"), "forward+backward"),
                  term("autocast_weight_copies", alone, _COPIES.format(when="at a micro-step's activation peak"),
                       ACCUMULATING)]
    return terms + [term("grads", grads_bytes, "param.grad", m) for m in ("reduce", "step:flatten", "step:update")]


def step_transients(shape: StepShape) -> list[Term]:
    """What the optimizer's step allocates and frees beyond the model states and DeepSpeed's step buffers, on the
    device (an offloaded optimizer's own temporaries are host memory: host_step_temporaries)."""
    stage = shape.stage if shape.use_deepspeed else 0
    own = [] if shape.offloaded else optimizer_temporaries(shape, shape.device)
    return rules_for(stage).step_transients(shape) + own


def host_step_temporaries(shape: StepShape) -> list[Term]:
    """An offloaded optimizer steps the host partitions: what it allocates there while stepping."""
    return optimizer_temporaries(shape, "cpu") if shape.offloaded else []

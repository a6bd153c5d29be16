"""One job's prediction, per rank, every term named: the step's peak moment by moment (what is held throughout
counted once, plus the largest moment's terms), host, NVMe, the run's phases and the time floor, from the
validated DeepSpeed dict and a fake-tensor trace: no GPU, no weights, no fitted factor. Checked on a CPU against
a real step through the trainer (benchmarks/bench_plan_step.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zerotune.config.schema import DTYPE_BYTES, MIB, launch_world_size
from zerotune.models import text_encoders
from zerotune.plan import allocator, cpu_optimizer, gpus, host_memory, zero3_replay
from zerotune.plan.activations import Trace, trace_step
from zerotune.plan.allocator import CONTEXT, CUBLAS_WORKSPACE
from zerotune.plan.model_states import Partitioning, rules_for
from zerotune.plan.phases import run_peak, run_phases, validation_pass_terms
from zerotune.plan.resolve import ResolvedRun
from zerotune.plan.rules import (
    StepShape,
    frozen_numels,
    offload_devices,
    optimizer_temporaries,
    term,
    zero_stage,
)
from zerotune.plan.stage0 import ACCUMULATING
from zerotune.rundir.plan import PERSISTENT, Plan, Term, mib_of

if TYPE_CHECKING:
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
    """Plain accelerate: the step traced as it runs (fp32 weights, autocast's forward and its weight copies, fp32
    gradients). The first micro-step peaks with the gradients growing; a later one (ACCUMULATING) holds them all."""
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


def predict(resolved: ResolvedRun, gpu: gpus.GPU | None, device: str = "cuda") -> Plan:
    """The prediction for rank 0 of the resolved job (ranks differ by alignment padding only). `device`: cuda (the
    card: nvidia-smi's view, the run's phases) or cpu (this machine: one pool of host memory, the processes' RSS)."""
    cfg, ds, use_ds, stage = resolved.config, resolved.ds_config, resolved.use_deepspeed, zero_stage(resolved)
    world, precision = launch_world_size(cfg.launch), cfg.precision.name
    trace = trace_step(cfg.model, resolved.input_shape, int(ds["train_micro_batch_size_per_gpu"]), precision,
                       cfg.train.gradient_checkpointing, cfg.model.attention, cfg.adapter)
    part = Partitioning.of(resolved, world, device)  # where the step runs decides plain accelerate's buffers
    states, buffers = part.states, {t.term: t for t in part.buffers(0)}
    shape = _step_shape(states, stage, use_ds, part.train, device, ds)
    step_terms = _step_terms(states, buffers, part.gpu_buffer_bytes(0), trace, shape)
    host_terms = _state_terms(states, "host")
    if cfg.ema.enabled:  # the EMA averages what the optimizer trains: the adapter alone under adapter=lora
        host_terms.append(term("ema", resolved.model_stats.num_trainable * 4,
                               "fp32 copy of the trained parameters, rank 0"))
    host_terms += [term(f"deepspeed:{name}", nbytes, _HOST_NOTES.get(name, "pinned")) for name, nbytes in
                   part.host_buffer_bytes(0).items()]
    host_terms += host_step_temporaries(shape)
    host_peak, load = _host_peak(resolved, host_terms, stage, world)
    per_node, nvme_terms = cfg.launch.num_processes, _state_terms(states, "nvme")
    plan = Plan.made(workload=_workload(resolved, world, stage, shape.offloaded), device=device,
                     trainable_params=resolved.model_stats.num_trainable, frozen_params=resolved.model_stats.num_frozen,
                     gpu=gpu.as_dict() if gpu else None, world_size=world, rank=0,
                     trace={"key": trace.key, "seconds": trace.seconds}, host_peak_mib=per_node * host_peak,
                     host_terms=[*host_terms, load], nvme_mib=per_node * mib_of(nvme_terms), nvme_terms=nvme_terms)
    if device == "cpu":  # one pool: what the plan puts "on the GPU" and on the host are both host memory here
        pool = step_terms + [t for t in host_terms if not host_memory.cuda_only(t.term)]  # a CPU pins nothing
        peak, moment = step_peak(pool)
        plan = plan.adding(gpu_peak_mib=None, gpu_terms=[], fits=None, step_terms=pool)
    else:
        gpu_terms = _cuda_terms(gpu, param_blocks(part.numels, stage, precision, use_ds, states, part.train)) + step_terms
        replayed = zero3_replay.step_terms(cfg, resolved, gpu) if use_ds and stage == 3 and gpu else None
        if replayed is not None:  # ZeRO-3's step as the card's allocator sees it, in place of the rules' sum
            gpu_terms = [t for t in gpu_terms if t.term == "cuda_context"] + replayed
        peak, moment = step_peak(gpu_terms)
        plan = plan.adding(gpu_peak_mib=peak, gpu_terms=gpu_terms, fits=None if gpu is None else peak <= gpu.memory_mib)
    plan = plan.adding(step_peak_mib=peak, step_peak_moment=moment,
                       **_times(gpu, trace, states, ds, precision, resolved.client_optimizer))
    passes = validation_pass_terms(cfg, resolved)  # what a validation pass adds, on any device (None: no prompts)
    if passes is not None:
        plan = plan.adding(sampling_pass_terms=passes[0])
    # Beyond the step: on a CPU, what the job's processes hold (their import baseline and the step's tensors);
    # on a card, the run's phases as nvidia-smi shows them (a block freed by an earlier phase stays reserved).
    if device == "cpu":
        node = host_memory.node_rss_prediction(plan, cfg.launch.num_processes, host_memory.process_baseline_mib(),
                                           host_memory.PARENT_BASELINE_MIB)
        return host_memory.mark_process_prediction(plan, node)
    phases = run_phases(cfg, resolved, gpu, plan)
    top = run_peak(phases)
    plan = plan.adding(phases=phases, run_peak_mib=top.reserved_mib, run_peak_phase=top.phase,
                       fits=None if gpu is None else top.reserved_mib <= gpu.memory_mib)
    # the host figure as the run measures it: the workers' RSS, each its process baseline and its host terms
    return host_memory.card_process_prediction(plan, per_node)


_HOST_NOTES = {host_memory.HEAP_KEPT: "the parameters' run-dtype copies glibc's heap keeps after the module moves to the "
                              "card (host.py heap_kept_bytes)"}


def _step_shape(states: dict, stage: int, use_ds: bool, train: list[int], device: str, ds: dict) -> StepShape:
    part = states.get("partition_numel") or sum(train)
    bucket = ds.get("zero_optimization", {}).get("reduce_bucket_size")
    one_flush = use_ds and stage >= 2 and isinstance(bucket, (int, float)) and bucket >= sum(train)
    groups = tuple(states.get("step_groups") or ()) if use_ds and stage in (1, 2) else ()
    largest = {0: max(train, default=0), 1: max(groups, default=part), 2: max(groups, default=part)}.get(
        stage if use_ds else 0)
    if largest is None:  # ZeRO-3: the optimizer steps one sub-group at a time
        largest = states["master_weights_bytes"] // max(1, states["elem_bytes"]["master_weights"]) // max(
            1, states.get("sub_groups", 1))
    return StepShape(stage, use_ds, states["optimizer"], states["elem_bytes"]["params"],
                     states["elem_bytes"]["master_weights"], states["where"]["optimizer_state"] != "gpu",
                     part if use_ds and stage else sum(train), largest, device, groups,
                     tuple(states.get("step_group_grads") or ()) if groups else (), one_flush)


def _step_terms(states: dict, buffers: dict[str, Term], buffer_bytes: dict, trace: Trace,
                shape: StepShape) -> list[Term]:
    """Every term the device holds during the step, each with its moment; `buffers`: the buffers' terms by name."""
    terms = [t for t in _state_terms(states, "gpu") if t.term != "grads"]
    if states["where"]["params"] != "gpu" and states.get("params_persistent_bytes"):
        terms.append(term("params_persistent", states["params_persistent_bytes"], "kept whole on the device"))
    if shape.use_deepspeed and shape.stage == 3 and states["where"]["grads"] == "gpu":
        terms.append(term("grads", states["grads_bytes"], "ZeRO-3's flat gradient partition"))
    terms += gradient_terms(shape, states["grads_bytes"], trace)
    terms += [term(f"deepspeed:{name}", nbytes, buffers[name].note, _MOMENT.get(buffers[name].moment or PERSISTENT,
                                                                             PERSISTENT))
              for name, nbytes in buffer_bytes.items()]
    return terms + step_transients(shape)


# buffers.py's lifetimes -> step_peak.py's moments
_MOMENT = {"backward": "forward+backward", **{m: m for m in MOMENTS}}


def _cuda_terms(gpu: gpus.GPU | None, blocks: tuple[list[int], str]) -> list[Term]:
    """What only a CUDA device holds: its context, cuBLAS's workspace, the caching allocator's rounding."""
    family = gpu.family if gpu else "unknown"
    context = CONTEXT.get(family)
    sizes, how = blocks
    return [term("cuda_context", context["bytes"] if context else 0,
                  context["source"] if context else "unknown card: no CUDA context figure"),
            term("cublas_workspace", CUBLAS_WORKSPACE.get(family, 0), "torch's default per handle + cuBLASLt"),
            term("allocator_rounding", allocator.reserved_bytes(sizes) - sum(sizes), how)]


def _times(gpu: gpus.GPU | None, trace: Trace, states: dict, ds: dict, precision: str,
           client: dict | None = None) -> dict[str, Any]:
    opt_device, param_device = offload_devices(ds)
    flops = (trace.forward_flops + trace.backward_flops) * int(ds["gradient_accumulation_steps"])
    compute = flops / (gpu.bf16_tflops * 1e12) if gpu and gpu.bf16_tflops and precision != "fp32" else None
    terms = [Term.timing("compute", compute, f"{flops / 1e12:,.1f} TFLOP over the dense bf16 peak" if compute is not None
                         else "unmeasured: no " + ("card named" if not gpu or not gpu.bf16_tflops
                                                   else "fp32 peak in the catalog"))]
    moved = 0
    if opt_device != "none":  # gradients down, updated (trainable) params up, every step
        moved += states["grads_bytes"] + states["trainable_params_bytes"]
    if param_device != "none":  # params fetched for forward and again for backward
        moved += 2 * states["params_bytes"]
    if moved:
        link = gpu.host_link_gbps if gpu and gpu.host_link_gbps else None
        terms.append(Term.timing("pcie", moved / (link * 1e9) if link else None,
                                 f"{moved / MIB:,.0f} MiB per step over the host link"))
    if opt_device != "none" and client is not None:  # CPU-Adam's figure says nothing about another class
        terms.append(Term.timing("cpu_optimizer", None, f"unmeasured: {states['optimizer']} on the host is not "
                                 "timed here (DeepSpeed's CPU-Adam figure does not apply)"))
    elif opt_device != "none":
        figure = cpu_optimizer.cpu_adam_figure()
        partition = states["master_weights_bytes"] // 4
        terms.append(Term.timing("cpu_optimizer", figure.s_per_param * partition if figure else None,
                                 _cpu_adam_note(figure)))
    known = [t for t in terms if t.seconds is not None]
    bound = max(known, key=lambda t: t.seconds or 0.0) if known else None
    return {"time_floor_s": bound.seconds if bound else None, "bound": bound.term if bound else None,
            "time_terms": terms}


def _cpu_adam_note(figure: cpu_optimizer.CpuAdamFigure | None) -> str:
    if figure is None:
        return f"unmeasured: {cpu_optimizer.why_unmeasured()}"
    when = "just now" if figure.timed_now else "earlier (this host's cache; no probe ran)"
    return f"DeepSpeed CPU-Adam, timed on this host {when} over {figure.params / 1e6:,.0f}M parameters"


def _workload(resolved: ResolvedRun, world: int, stage: int, offloaded: bool) -> str:
    cfg, ds, stats, adapter = resolved.config, resolved.ds_config, resolved.model_stats, resolved.config.adapter
    words = (f"model={cfg.model.name} resolution={cfg.resolution.size} batch {ds['train_micro_batch_size_per_gpu']}"
             f"x{ds['gradient_accumulation_steps']} per rank, {world} rank(s), ZeRO-{stage}, optimizer offload "
             f"{offload_devices(ds)[0] if offloaded else 'none'}, {cfg.precision.name}, gradient checkpointing "
             f"{'on' if cfg.train.gradient_checkpointing else 'off'}")
    trained = text_encoders.trained(cfg.model)
    if trained:  # one engine: their states, gradients and activations are in every term below
        words += f", text encoders trained with the U-Net: {' and '.join(trained)}"
    if adapter is None or adapter.name == "none":
        return words
    return (f"{words}, adapter {adapter.name} rank {adapter.rank}: {stats.num_trainable:,} parameters "
            f"trained, {stats.num_frozen:,} frozen")


def _state_terms(states: dict, place: str) -> list[Term]:
    """The model states that live in `place` (gpu | host | nvme), as model_states.py places them."""
    terms = []
    for key in ("params", "grads", "master_weights", "optimizer_state"):
        if key == "master_weights" and states.get("master_weights_alias_params"):
            continue  # fp32 ZeRO-3 without offload: the partitions are the parameters themselves
        nbytes = states[f"{key}_bytes"]
        if key == "params" and place != "gpu":  # ZeRO-3's whole small parameters stay on the device
            nbytes -= states.get("params_persistent_bytes") or 0
        if states["where"][key] == place and nbytes:
            name = "optimizer_states" if key == "optimizer_state" else key
            note = f"{states['elem_bytes'][key]} B/element"
            if key == "optimizer_state":  # which optimizer, and the line that allocates its state
                note = f"{states['optimizer']}: {states.get('optimizer_source', '')}"
            terms.append(term(name, nbytes, note))
    return terms


def param_blocks(numels: list[int], stage: int, precision: str, use_ds: bool, states: dict,
                 trainable: list[int] | None = None) -> tuple[list[int], str]:
    """The allocations (bytes) that hold the parameters on the GPU, and how: ZeRO-1/2 one flat buffer for the
    trained ones and a block per frozen one; stage 0 and plain DDP a block per parameter; stage 3 none (its
    buffers count them). `trainable`: the optimizer's sizes (None: all)."""
    if stage >= 3 or states["where"]["params"] != "gpu":
        return [], "no parameter blocks on the GPU outside ZeRO-3's buffers"
    elem = DTYPE_BYTES[precision]
    separate = "parameters as separate blocks: 512 B rounding, 2/20 MiB segments"
    if not (use_ds and stage in (1, 2)):
        return [n * elem for n in numels], separate
    train = numels if trainable is None else trainable
    flat = [sum(train) * elem]
    frozen = frozen_numels(numels, train)
    if not frozen:
        return flat, "one flat parameter buffer: rounded up to 2 MiB"
    return flat + [n * elem for n in frozen], "the trainable parameters' flat buffer (rounded up to 2 MiB); the " \
        "frozen ones as separate blocks: 512 B rounding, 2/20 MiB segments"


def _host_peak(resolved: ResolvedRun, terms: list[Term], stage: int, world: int) -> tuple[float, Term]:
    """(MiB, the `model_load` term): the larger of the host terms and the U-Net's build, which comes first: whole
    in fp32 below ZeRO-3; at ZeRO-3 (zero.Init) the rank's partition plus one module whole in fp32, counted as
    twice the largest parameter (its build and the copy being split)."""
    stats, precision = resolved.model_stats, resolved.config.precision.name
    if stage == 3:
        partition = -(-stats.num_params // world) * DTYPE_BYTES.get(precision, 4)
        # adapter=lora: the targets are gathered whole while peft wraps them (models/adapter.py gathered_targets),
        # onto the device the run trains on: the host's only on a CPU run.
        on_host = resolved.platform.device_type == "cpu"
        gathered = stats.adapter_target_numel * DTYPE_BYTES.get(precision, 4) if on_host else 0
        load = term("model_load", partition + max(2 * 4 * stats.largest_param_numel, gathered),
                     f"zero.Init build: this rank's 1/{world} partition + one module whole in fp32 (transient)"
                     + (", or the adapter's targets gathered whole while peft wraps them" if gathered else ""))
    else:
        load = term("model_load", stats.num_params * 4, "fp32 build before the move (transient)")
    return max(mib_of(terms), load.mib or 0.0), load

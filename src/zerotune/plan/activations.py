"""The training step's activation memory and FLOPs, traced on fake tensors of the model built as training builds
it (no weights, no GPU; SDXL at 1024 px, batch 8, in 8 s on 2 cores), cached in this process and on disk
(<cache>/plan/trace-<key>.json, <cache> being $ZEROTUNE_CACHE_DIR or ~/.cache/zerotune)."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import re
import time
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MethodType
from typing import Any, NamedTuple, cast

import torch

from zerotune.config import files
from zerotune.config.errors import ConfigError
from zerotune.config.schema import Adapter, Diffusion, Model
from zerotune.models import (
    adapter,
    backbones,
    build_network,
    diffusion,
    text_encoders,
    trained_encoder_archs,
    unet_config,
)
from zerotune.models.flow_matching import FlowMatching
from zerotune.plan.stage0 import cast_policy

# The fake tensors are CPU tensors: on a CPU-only torch the autograd engine aborts on the first fake CUDA tensor
# that requires grad. Bytes do not depend on the device, but attention runs torch's CPU flash kernel (it saves what
# CUDA's kernels save) and nothing is rounded to the CUDA allocator's 512 B blocks (a few kB).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TRACE_FORMAT = 3  # bump when what a trace measures changes: older cache entries then miss
_TRACES: dict[str, Trace] = {}  # this process's traces, by key
_ASKED: dict[str, tuple] = {}  # trace_step's arguments by the key of the trace it gave (this process): plain_trace
AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Trace:
    """One traced training step (forward + loss + backward) of one micro batch.
    activation_peak_bytes: the most the step holds beyond the model's states (parameters, buffers, parameter
    gradients), sampled after every op: inputs, saved and recomputed activations, temporaries, a parameter
    gradient until autograd hands it over; no kernel workspaces or allocator caching. Within 4% of the
    allocator's for the same step run on the CPU (measure_step_on_cpu, tests/test_plan_activations.py).
    activation_and_grad_peak_bytes: the same with the parameter gradients accumulated so far.
    param_bytes, grad_bytes: at the end of backward, at the traced precision (an adapter's gradients only).
    forward_flops (with the loss), backward_flops (with checkpointing's recomputation): matmuls, convolutions
    and attention only. seconds: how long the trace took when made; key: its cache key."""

    activation_peak_bytes: int
    activation_and_grad_peak_bytes: int
    param_bytes: int
    grad_bytes: int
    forward_flops: int
    backward_flops: int
    seconds: float
    key: str
    # Plain accelerate's autocast (trace_step(..., autocast=...)): the half-precision copies of fp32 weights the
    # forward makes (autocast's cached_cast), alive at the activation peak, at the joint peak, and at most; part of
    # the two peaks above. 0 without autocast.
    weight_copies_at_activation_peak_bytes: int = 0
    weight_copies_at_joint_peak_bytes: int = 0
    weight_copies_peak_bytes: int = 0


def trace_step(model_cfg: Model, latent_shape: tuple[int, int, int], batch: int, precision: str,
               gradient_checkpointing: bool, attention: str, adapter_cfg: Adapter | None = None,
               autocast: str | None = None) -> Trace:
    """The trace of one training step of `model_cfg`'s U-Net on `batch` inputs of `latent_shape` ((channels,
    height, width)), cached. `precision`: the parameters' dtype under DeepSpeed; `attention`: sdpa | default.
    `autocast`: None (the module cast to `precision`), or the device (cpu | cuda) plain accelerate runs the step
    on: fp32 weights and inputs, the forward under torch.autocast to `precision` with that device's cast policy."""
    if precision not in DTYPES:
        raise ConfigError("precision", f"unknown precision {precision!r}", "precision=bf16, fp16 or fp32")
    if autocast is not None and (autocast not in AUTOCAST_DEVICES or precision == "fp32"):
        raise ValueError(f"autocast {autocast!r} to {precision}: autocast is to bf16 or fp16, on cpu or cuda")
    # The run's own adapter block all the way down: each step reads its settings from it.
    key = trace_key(model_cfg, latent_shape, batch, precision, gradient_checkpointing, attention, adapter_cfg, autocast)
    if autocast is None:
        _ASKED[key] = (model_cfg, latent_shape, batch, precision, gradient_checkpointing, attention, adapter_cfg)
    file = cache_dir() / f"trace-{key}.json"
    if key not in _TRACES:
        try:
            _TRACES[key] = Trace(**files.read_json(file))  # type: ignore[arg-type]
        except TypeError:  # absent, or unreadable (a partial write): trace again
            _TRACES[key] = _trace(model_cfg, cast("tuple[int, int, int]", tuple(latent_shape)), batch, precision,
                                  gradient_checkpointing, attention, key, adapter_cfg, autocast)
            files.write_cached_json(file, asdict(_TRACES[key]))
    return _TRACES[key]


def plain_trace(trace: Trace, device: str) -> Trace:
    """The step `trace` is of (trace_step's answer in this process, the module cast to the run's dtype), as plain
    accelerate runs it on `device` (cpu | cuda): fp32 weights, the forward under autocast (trace_step's
    `autocast`). An fp32 run's trace is its own: no autocast, fp32 weights either way."""
    if trace.key not in _ASKED:
        raise KeyError(f"no trace_step call in this process gave the trace {trace.key}")
    model_cfg, latent_shape, batch, precision, checkpointing, attention, adapter_cfg = _ASKED[trace.key]
    if precision == "fp32":
        return trace
    return trace_step(model_cfg, latent_shape, batch, precision, checkpointing, attention, adapter_cfg, device)


def trace_key(model_cfg: Model, latent_shape: tuple[int, int, int], batch: int, precision: str,
              gradient_checkpointing: bool, attention: str, adapter_cfg: Adapter | None = None,
              autocast: str | None = None) -> str:
    """Readable and unique: the model's name, a hash of what shapes its step (architecture, conditioning,
    objective, adapter), the step's own settings and the torch version."""
    fields = adapter.settings(adapter_cfg)
    model = {"unet": unet_config(model_cfg), "conditioning": model_cfg.conditioning,
             "text_seq_len": model_cfg.text_seq_len, "prediction_type": model_cfg.prediction_type,
             "adapter": fields}
    if backbones.is_transformer(model_cfg):  # absent for U-Nets: their traces keep their keys
        model.update(backbone=model_cfg.backbone, transformer=backbones.backbone_of(model_cfg).arguments())
    trained = trained_encoder_archs(model_cfg)
    if trained:  # the text encoders trained in the same step (absent otherwise: earlier traces keep their keys)
        model["text_encoders"] = trained
    digest = hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode()).hexdigest()[:12]
    shape = "x".join(str(int(n)) for n in latent_shape)
    tuned = (f"{fields['name']}-r{fields.get('rank')}" if fields else "full") + (
        f"-te_{model_cfg.train_text_encoder}" if trained else "")
    amp = f"amp_{autocast}-" if autocast else ""  # absent without autocast: the engine's traces keep their keys
    key = (f"{model_cfg.name}-{digest}-{shape}-b{int(batch)}-{precision}-{amp}"
           f"{'gc' if gradient_checkpointing else 'nogc'}-{attention}-{tuned}-torch{torch.__version__}-v{TRACE_FORMAT}")
    return re.sub(r"[^A-Za-z0-9._+-]", "_", key)


def cache_dir() -> Path:
    return files.cache_dir("plan")


def _trace(model_cfg: Model, latent_shape: tuple[int, int, int], batch: int, precision: str,
           gradient_checkpointing: bool, attention: str, key: str, adapter_cfg: Adapter | None = None,
           autocast: str | None = None) -> Trace:
    # Here, on a cache miss only: importing torch's MemTracker takes ~1 s, which every job start would pay.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _MemRefType

    start = time.perf_counter()
    weights = "fp32" if autocast else precision  # plain accelerate keeps fp32 weights, and feeds fp32 inputs
    unet = _meta_trained(model_cfg, weights, gradient_checkpointing, attention, adapter_cfg)
    # Non-fake inputs allowed: the noise scheduler's small constant tables are real tensors.
    with FakeTensorMode(allow_non_fake_inputs=True), cast_policy(autocast):
        unet.to_empty(device="cpu")
        if autocast:
            autocast_forward(unet, precision)
        tracker = _tracker()
        tracker.track_external(unet)
        with tracker, torch.enable_grad():
            inputs = _inputs(model_cfg, latent_shape, batch, DTYPES[weights])
            _loss(unet, model_cfg, inputs).backward()
            params, grads = tracker.held(_MemRefType.PARAM), tracker.held(_MemRefType.GRAD)
        tracker.stop_counting_copies()
    return Trace(activation_peak_bytes=tracker.activation_peak,
                 activation_and_grad_peak_bytes=tracker.activation_and_grad_peak, param_bytes=params, grad_bytes=grads,
                 forward_flops=tracker.flops["forward"], backward_flops=tracker.flops["backward"],
                 seconds=round(time.perf_counter() - start, 3), key=key,
                 weight_copies_at_activation_peak_bytes=tracker.copies_at_activation_peak if autocast else 0,
                 weight_copies_at_joint_peak_bytes=tracker.copies_at_joint_peak if autocast else 0,
                 weight_copies_peak_bytes=tracker.copies_peak if autocast else 0)


def _tracker() -> Any:
    """step_tracker.StepTracker also counting the half-precision copies autocast makes of parameters (an
    aten._to_copy of one): alive, at the two peaks, and at most. Defined here: importing MemTracker takes ~1 s."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.utils.weak import WeakIdKeyDictionary

    from zerotune.plan.step_tracker import StepTracker

    class CopyTracker(StepTracker):
        def __init__(self) -> None:
            super().__init__()
            self.copies_live = self.copies_peak = self.copies_at_activation_peak = self.copies_at_joint_peak = 0
            self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
            self._finalizers: list[weakref.finalize] = []
            self._casting_param = False

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            source = args[0] if func is torch.ops.aten._to_copy.default and args else None
            self._casting_param = isinstance(source, torch.Tensor) and source.dtype == torch.float32 and \
                getattr(self._WINFO.get(source.untyped_storage(), (None, None))[0], "reftype", None) == \
                _MemRefType.PARAM
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._casting_param = False

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            # Called for the op's outputs before the peaks are updated: the copy counts at this op's sample.
            if self._casting_param and t.dtype in (torch.float16, torch.bfloat16):
                storage = t.untyped_storage()
                if storage not in self._copies:
                    self._copies[storage] = nbytes = storage.nbytes()
                    self.copies_live += nbytes
                    self._finalizers.append(weakref.finalize(storage, self._freed, nbytes))
            super()._track(reftype, t)

        def _freed(self, nbytes: int) -> None:
            self.copies_live -= nbytes

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = (self.activation_peak, self.activation_and_grad_peak)
            super()._update_peak_stats(peak_state)
            if self.activation_peak > before[0]:
                self.copies_at_activation_peak = self.copies_live
            if self.activation_and_grad_peak > before[1]:
                self.copies_at_joint_peak = self.copies_live
            self.copies_peak = max(self.copies_peak, self.copies_live)

        def stop_counting_copies(self) -> None:
            for found in self._finalizers:  # copies still alive (none after backward): nothing runs at exit
                found.detach()

    return CopyTracker()


# --------------------------------------------------------------------------- plain accelerate's mixed precision

def autocast_forward(module: torch.nn.Module, precision: str) -> None:
    """What accelerate's prepare_model does under mixed precision: forward wrapped in torch.autocast, its outputs
    converted to fp32. The autocast's exit clears its weight-copy cache; backward keeps the copies its nodes saved.
    CPU's autocast key (the trace's tensors are CPU ones), CUDA's policy under cast_policy("cuda")."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = torch.autocast("cpu", dtype=DTYPES[precision])(type(module).forward)
    module.forward = MethodType(convert_outputs_to_fp32(forward), module)  # type: ignore[method-assign]


def _unet_as_trained(model_cfg: Model, precision: str, gradient_checkpointing: bool, attention: str,
                     adapter_cfg: Adapter | None = None) -> torch.nn.Module:
    """The U-Net as trained, from its architecture config: `attention`, the adapter (base frozen), every
    parameter cast as DeepSpeed's engine casts it, the gradient checkpointing switch."""
    without_weights = replace(model_cfg, pretrained=None, attention=attention)
    unet = adapter.add_adapter(build_network(without_weights), adapter_cfg)
    torch.nn.Module.to(unet, DTYPES[precision])  # nn.Module's: diffusers' own `to` warns about fp32 modules
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()  # type: ignore[operator]  # diffusers' ModelMixin method
    return _traceable(unet.train())


def _traceable(module: torch.nn.Module) -> torch.nn.Module:
    """LoHa's and LoKr's layers (peft's LycorisLayer) draw their module dropout in training as a Python `if` on
    torch.rand(1), which a fake tensor cannot answer: in eval mode they skip the draw and add the same delta
    (adapter.dropout's rank dropout mask, one value per rank, is then left out of the trace)."""
    from peft.tuners.lycoris_utils import LycorisLayer

    for layer in module.modules():
        if isinstance(layer, LycorisLayer):
            layer.eval()
    return module


def _as_trained(model_cfg: Model, precision: str, gradient_checkpointing: bool, attention: str,
                adapter_cfg: Adapter | None = None) -> torch.nn.Module:
    """The engine's module: the U-Net as trained, with the text encoders model.train_text_encoder trains beside it
    (models/text_encoders.py UNetWithTextEncoders), each built, adapted, cast and checkpointed as the trainer does."""
    unet = _unet_as_trained(model_cfg, precision, gradient_checkpointing, attention, adapter_cfg)
    archs = trained_encoder_archs(model_cfg)
    if not archs:
        return unet
    built = {}
    for name, arch in archs.items():
        encoder = text_encoders.add_adapter(text_encoders.build(name, arch), adapter_cfg)
        torch.nn.Module.to(encoder, DTYPES[precision])
        if gradient_checkpointing:
            text_encoders.checkpointing_on(encoder)
        built[name] = _traceable(encoder.train())
    return text_encoders.UNetWithTextEncoders(unet, built, pooled=model_cfg.conditioning == "text_time",
                                              first_width=text_encoders.first_width(model_cfg))


def _meta_trained(model_cfg: Model, precision: str, gradient_checkpointing: bool, attention: str,
                  adapter_cfg: Adapter | None = None) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights():
        return _as_trained(model_cfg, precision, gradient_checkpointing, attention, adapter_cfg)


def _meta_unet(model_cfg: Model, precision: str, gradient_checkpointing: bool, attention: str,
               adapter_cfg: Adapter | None = None) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights():
        return _unet_as_trained(model_cfg, precision, gradient_checkpointing, attention, adapter_cfg)


def _inputs(model_cfg: Model, latent_shape: tuple[int, int, int], batch: int, dtype: torch.dtype) -> dict:
    """One micro batch as the trainer hands it to the objective: float tensors in the training dtype
    (Trainer._to_device), the conditioning of the model's kind (data/sources.py's shapes), the objective's draws."""
    widths = backbones.backbone_of(model_cfg).text_widths()
    x0 = torch.randn(batch, *latent_shape, dtype=dtype)
    drawn = {"x0": x0, "noise": torch.randn_like(x0),
             "timesteps": _timesteps(model_cfg, batch)}
    if model_cfg.conditioning == "class":
        cond = {"class_labels": torch.randint(int(model_cfg.num_classes), (batch,))}
    else:
        seq = int(model_cfg.text_seq_len)
        cond = {"encoder_hidden_states": torch.randn(batch, seq, widths.hidden, dtype=dtype)}
        if model_cfg.conditioning == "text_time":  # SDXL's added conditioning
            cond.update(text_embeds=torch.randn(batch, widths.pooled, dtype=dtype),
                        time_ids=torch.randn(batch, 6, dtype=dtype))
        elif model_cfg.conditioning == "text_pooled":  # FLUX.1 / SD3: the pooled embedding
            cond.update(pooled_projections=torch.randn(batch, widths.pooled, dtype=dtype))
    tokens = {text_encoders.TOKENS[name]: torch.randint(int(arch["vocab_size"]), (batch, int(model_cfg.text_seq_len)))
              for name, arch in trained_encoder_archs(model_cfg).items()}
    if tokens:  # the trained encoders encode the tokens inside the engine's module (Trainer.forward_backward)
        return {**drawn, "cond": {"batch": {**cond, **tokens}, "drop": None}}
    return {**drawn, "cond": diffusion.unet_kwargs(model_cfg.conditioning, cond)}


def _objective(model_cfg: Model) -> diffusion.NoisePrediction | FlowMatching:
    """The model's objective on its default settings (the loss's memory does not depend on them); a fresh one:
    DDPM's add_noise caches its tables on the device of the samples it last saw. Its schedule is made of real
    tensors, also inside a trace's fake mode: the flow schedule reads one of its values (sigmas[-1].item())."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return diffusion.objective_of(model_cfg, Diffusion(prediction_type=model_cfg.prediction_type))


def _timesteps(model_cfg: Model, batch: int) -> torch.Tensor:
    """The objective's draws for `batch` samples, real tensors (indices into a real schedule) in a fake mode too."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    objective = _objective(model_cfg)
    with unset_fake_temporarily():
        return objective.draw_timesteps(batch, torch.Generator().manual_seed(0))


def _loss(network: torch.nn.Module, model_cfg: Model, inputs: dict) -> torch.Tensor:
    """The trainer's loss (Trainer.forward_backward): the objective over the backbone's call."""
    net, x0 = backbones.backbone_of(model_cfg), inputs["x0"]

    def predict(noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return net.predict(network, noisy.to(x0.dtype), t, inputs["cond"], Diffusion.guidance_scale)

    return _objective(model_cfg).loss(predict, x0, inputs["noise"], inputs["timesteps"])


class MeasuredPeaks(NamedTuple):
    between_ops: int       # what activation_peak_bytes measures: sampled as each op returns
    with_workspaces: int   # every allocation counted, kernels' internal scratch buffers included


def measure_step_on_cpu(model_cfg: Model, latent_shape: tuple[int, int, int], batch: int,
                        gradient_checkpointing: bool, attention: str, precision: str = "fp32",
                        adapter_cfg: Adapter | None = None, autocast: str | None = None) -> MeasuredPeaks:
    """The check on trace_step, independent of MemTracker: the same step run for real on this CPU, torch.profiler's
    running total of allocations and frees from the built model on (parameter gradients dropped as autograd
    accumulates them). `between_ops`: the total as each outermost aten op returns, as the trace samples;
    `with_workspaces`: its maximum, with kernels' scratch buffers (im2col columns, mostly), which no tensor trace
    sees and which differ on cuDNN anyway. `autocast`: as trace_step's."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    weights = "fp32" if autocast else precision
    unet = _as_trained(model_cfg, weights, gradient_checkpointing, attention, adapter_cfg)
    if autocast:
        autocast_forward(unet, precision)
    for p in unet.parameters():
        if p.requires_grad:  # frozen parameters (an adapter's base) get no gradient
            p.register_post_accumulate_grad_hook(_drop_grad)
    with cast_policy(autocast), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.enable_grad():
        inputs = _inputs(model_cfg, latent_shape, batch, DTYPES[weights])
        _loss(unet, model_cfg, inputs).backward()
    return _peaks(prof.profiler.kineto_results.events())


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _peaks(events: list) -> MeasuredPeaks:
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in memory]
    totals = list(itertools.accumulate(n for _, n in memory))  # held after each allocation or free
    # The total as each op returns: after the last allocation or free at or before its end.
    at_op_ends = [totals[i - 1] for i in (bisect.bisect_right(times, end) for end in _outermost_op_ends(events)) if i]
    return MeasuredPeaks(between_ops=max(at_op_ends, default=0), with_workspaces=max(totals, default=0))


def _outermost_op_ends(events: list) -> list[int]:
    """When each aten op not called by another aten op returned (autograd's engine is no op: the ops of a
    backward node, and of checkpointing's recomputation, count one by one)."""
    ops = sorted((e.start_ns(), e.end_ns()) for e in events if e.name().startswith("aten::"))
    ends: list[int] = []
    for start, end in ops:
        if not ends or start > ends[-1]:
            ends.append(end)
    return ends

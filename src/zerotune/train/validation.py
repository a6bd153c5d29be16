"""Validation passes during training: the same prompts with the same seeds at step 0, every N steps and at the end,
each rank sampling its share; rank 0 writes <run dir>/samples/step-NNNNNNN/ (<prompt name>[-ema].png, grid.png,
prompts.json) and logs validation/<prompt name>. A pass draws from its own generators and puts every weight back,
so training after it is bit-identical; a failed pass is recorded and the run goes on, unless validation.strict."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any, Protocol

import torch

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config
from zerotune.data.components import (
    FrozenEncoders,
    component_ids,
    resolve_components,
    tokenize,
)
from zerotune.data.latent_cache import FileHasher, LatentCache
from zerotune.data.prepare import cache_dir
from zerotune.data.prompts import ValidationPrompt, check_validation, enabled, weights_to_sample
from zerotune.data.spec import DataSpec
from zerotune.host.torch_memory import MeasuredPhase, largest
from zerotune.models import text_encoders
from zerotune.models.backbones import Encoded, backbone_of
from zerotune.models.weights import transformers_zero3_lifted
from zerotune.plan.resolve import ResolvedRun
from zerotune.rundir import SAMPLES, RunDir
from zerotune.rundir.loggers import RunLogger
from zerotune.rundir.plan import Plan, mib_of
from zerotune.train import distributed


@contextlib.contextmanager
def sampling_unet(engine: Any, module: torch.nn.Module, zero3: bool,
                  ema_shadow: dict[str, torch.Tensor] | None = None) -> Iterator[torch.nn.Module]:
    """`module` (the engine's U-Net) ready to sample: whole, in eval mode, with `ema_shadow` ({name: fp32 host
    tensor}) over the trained weights; put back on leaving. Under ZeRO-3 a collective: every rank enters and leaves."""
    with _whole(engine, module, zero3), _swapped(module, ema_shadow), torch.no_grad():
        was_training = module.training
        module.eval()  # dropout (LoRA's too) off
        try:
            yield module
        finally:
            module.train(was_training)


@contextlib.contextmanager
def _whole(engine: Any, module: torch.nn.Module, zero3: bool) -> Iterator[None]:
    """ZeRO-3: gather every partition (DeepSpeed's GatheredParameters; nothing written back on leaving) and lift
    the engine's forward hooks meanwhile: each sub-module's, which would release it after its forward and fetch it
    again at the next (a collective per call), and the root's start-of-forward hook, whose trace check is a
    collective too (a rank sampling more prompts than another would wait on it forever). TRL's
    unwrap_model_for_generation does the same; no library exposes it for a bare engine, hence these few lines."""
    if not zero3:
        yield
        return
    import deepspeed

    offload = _parameter_offload(engine)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        start_of_forward = _remove_hooks(offload)
        try:
            yield
        finally:
            _add_hooks(offload, start_of_forward)


def _parameter_offload(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        raise RuntimeError("ZeRO-3 validation needs the DeepSpeed engine's optimizer (its parameter coordinator)")
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_hooks(offload: Any) -> Any:
    """Every hook DeepSpeed's parameter offload put on the module; returns the root's start-of-forward hook."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    start_of_forward = offload.module._forward_pre_hooks[offload.fwd_pre_hook.id]
    offload.fwd_pre_hook.remove()
    return start_of_forward


def _add_hooks(offload: Any, start_of_forward: Any) -> None:
    # As setup_zero_stage3_hooks registers them: the root's start-of-forward hook first, then the modules'.
    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start_of_forward)
    # DeepSpeed >= 0.16.4 names it _register_deepspeed_module (it also invalidates the prefetch trace).
    offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, shadow: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """The EMA's weights in place of the trained ones, the trained ones kept on the host and copied back exactly."""
    if shadow is None:
        yield
        return
    params = dict(module.named_parameters())
    missing = sorted(set(shadow) - set(params))
    if missing:
        raise RuntimeError(f"the EMA holds weights the U-Net does not: {missing[:3]}")
    kept = {}
    with torch.no_grad():
        for name, value in shadow.items():
            p = params[name]
            kept[name] = p.detach().to("cpu", copy=True)
            p.copy_(value.to(p.device, p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                params[name].copy_(value.to(params[name].device))


log = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.json"


class Trained(Protocol):
    """What a pass samples with (the Trainer): its engine and the U-Net inside, its EMA and noise schedule."""
    unet: Any                    # DeepSpeed's engine, or accelerate's wrapped module
    ema: Any                     # train/engine.py HostEMA, or None
    noise_schedule: Any          # the training DDPMScheduler
    resolved: ResolvedRun

    def trained_module(self) -> torch.nn.Module: ...


class ValidationFailed(RuntimeError):
    """A pass failed under validation.strict=true."""


class Validator:
    def __init__(self, cfg: Config, prompts: list[ValidationPrompt], run_dir: RunDir, logger: RunLogger,
                 device: torch.device, dtype: torch.dtype, rank: int, world: int):
        self.cfg, self.v, self.prompts = cfg, cfg.validation, prompts
        self.run_dir, self.logger = run_dir, logger
        self.device, self.dtype, self.rank, self.world = device, dtype, rank, world
        self.weights = weights_to_sample(cfg)
        self.backbone = backbone_of(cfg.model)
        self.paths = resolve_components(cfg.model)
        self.mine = [p for i, p in enumerate(prompts) if i % world == rank]
        self.embeddings = self._encode_prompts()
        # With model.train_text_encoder, the prompts are encoded again at every pass, by the encoders as trained.
        trained = text_encoders.trained(cfg.model)
        texts = list(self.embeddings)
        self.tokens = tokenize(self.paths, trained, texts, cfg.model.text_seq_len) if trained and texts else {}
        self._vae: Any = None
        self.passes: list[dict] = []
        self.last_step: int | None = None

    # ---- when

    def due(self, step: int, max_steps: int) -> bool:
        """After optimizer step `step` inside the loop (the end pass, after the final save, is due_at_end's)."""
        every = int(self.v.every_n_steps)
        return every > 0 and step % every == 0 and not (step == max_steps and self.v.at_end)

    def due_at_start(self, step: int) -> bool:
        return bool(self.v.at_start) and step == 0

    def due_at_end(self, step: int) -> bool:
        return bool(self.v.at_end) and self.last_step != step

    # ---- a pass

    def run(self, step: int, trainer: Trained) -> dict:
        """Sample every prompt at `step` (every rank calls it: a collective under ZeRO-3); rank 0 returns the
        pass's record, the other ranks theirs without files."""
        start = time.perf_counter()
        images, errors = self._sample_share(trainer, step)
        gathered = distributed.gather_object((images, errors))
        record: dict[str, Any] = {"step": step}
        if gathered is not None:
            all_images = {k: v for imgs, _ in gathered for k, v in imgs.items()}
            all_errors = [e for _, errs in gathered for e in errs]
            if all_images:
                record.update(self._write(step, all_images))
            if all_errors:
                record["errors"] = all_errors
                log.warning("validation at step %d failed: %s", step, all_errors[0]["message"])
        record["seconds"] = round(time.perf_counter() - start, 3)
        self.last_step = step
        failed = distributed.broadcast_object(bool(record.get("errors")))
        self.passes.append(record)
        if failed and self.v.strict:
            why = record["errors"][0]["message"] if "errors" in record else "on another rank"
            raise ValidationFailed(f"validation at step {step} failed ({why}); validation.strict=false records a "
                                   "failed pass and goes on")
        return record

    def summary(self) -> dict:
        return {"prompts": len(self.prompts), "weights": list(self.weights),
                "passes": self.passes, "failed_passes": sum(1 for p in self.passes if p.get("errors"))}

    def _sample_share(self, trainer: Trained, step: int) -> tuple[dict, list]:
        """This rank's prompts as PNG bytes {(name, weights): bytes}, and what failed."""
        debug = self.cfg.debug
        inject_oom = debug.validation_oom_at_step == step and debug.fail_rank in (None, self.rank)
        images: dict[tuple[str, str], bytes] = {}
        errors: list[dict] = []
        zero3 = trainer.resolved.zero_stage == 3
        try:
            for which in self.weights:
                shadow = trainer.ema.shadow if which == "ema" and trainer.ema is not None else None
                # Entered by every rank whatever happens inside (a collective under ZeRO-3): failures are caught within.
                with sampling_unet(trainer.unet, trainer.trained_module(), zero3, shadow) as module:
                    pipe = None
                    try:
                        embeddings = self._embeddings(module)
                        network = module.unet if isinstance(module, text_encoders.UNetWithTextEncoders) else module
                        pipe = self._pipeline(network, self._vae_on_device(), trainer)
                        if inject_oom:
                            raise torch.OutOfMemoryError(f"debug.validation_oom_at_step={step}: injected")
                        for p in self.mine:
                            images[(p.name, which)] = self._png(pipe, p, embeddings)
                    except Exception as exc:  # noqa: BLE001  (recorded; the run goes on unless strict)
                        errors.append(_error(exc, self.rank, which))
                    finally:
                        del pipe
        except Exception as exc:  # noqa: BLE001  (gathering or putting the weights back)
            errors.append(_error(exc, self.rank, None))
        finally:
            self._vae_off_device()
        return images, errors

    def _pipeline(self, network: torch.nn.Module, vae: Any, trainer: Trained) -> Any:
        schedule = dict(trainer.noise_schedule.config)  # type: ignore[attr-defined]  # diffusers' ConfigMixin
        scheduler = self.backbone.sampler(schedule, self.cfg.diffusion.prediction_type)
        pipe = self.backbone.sampling_pipeline(network, vae, scheduler)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _embeddings(self, module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """{text: (hidden states, pooled or None)}: the cached ones, or with trained text encoders theirs now (the
        frozen encoder's part still from the cache)."""
        if not self.tokens or not isinstance(module, text_encoders.UNetWithTextEncoders):
            return self.embeddings
        texts = list(self.embeddings)
        batch = {k: v.to(self.device) for k, v in self.tokens.items()}
        batch["encoder_hidden_states"] = torch.stack([self.embeddings[t][0] for t in texts]).to(self.device, self.dtype)
        pooled = [self.embeddings[t][1] for t in texts]
        if all(p is not None for p in pooled):
            batch["text_embeds"] = torch.stack(pooled).to(self.device, self.dtype)  # type: ignore[arg-type]
        states, new_pooled = module.encode(batch)
        return {t: (states[i], None if new_pooled is None else new_pooled[i]) for i, t in enumerate(texts)}

    def _png(self, pipe: Any, p: ValidationPrompt,
             embeddings: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> bytes:
        def on_device(encoded: tuple[torch.Tensor, torch.Tensor | None]) -> Encoded:
            return tuple(None if t is None else t[None].to(self.device, self.dtype) for t in encoded)  # type: ignore[return-value]

        negative = on_device(embeddings[p.negative_prompt]) if p.negative_prompt else None
        kwargs = self.backbone.sampling_kwargs(on_device(embeddings[p.prompt]), negative,
                                               float(self.v.guidance_rescale))
        image = pipe(width=p.width, height=p.height, num_inference_steps=p.steps, guidance_scale=p.guidance_scale,
                     generator=torch.Generator("cpu").manual_seed(p.seed), output_type="pil", **kwargs).images[0]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    # ---- files and the logger (rank 0, the run dir's writer: the only rank gather_object answers)

    def _write(self, step: int, images: dict[tuple[str, str], bytes]) -> dict:
        from PIL import Image

        folder = self.run_dir.path / SAMPLES / f"step-{step:07d}"
        rows, index = [], []
        folder.mkdir(parents=True, exist_ok=True)
        for p in self.prompts:
            files = {}
            for which in self.weights:
                data = images.get((p.name, which))
                if data is None:
                    continue
                name = f"{p.name}.png" if which == "model" else f"{p.name}-{which}.png"
                (folder / name).write_bytes(data)
                files[which] = name
            if files:
                rows.append([Image.open(io.BytesIO(images[(p.name, w)])).convert("RGB") for w in files])
                index.append({**asdict(p), "files": files})
                self.logger.log_images(f"validation/{p.name}", [str(folder / f) for f in files.values()], step=step)
        record: dict[str, Any] = {"folder": str(folder.relative_to(self.run_dir.path)),
                                  "images": sum(len(r) for r in rows)}
        if rows:
            _grid(rows).save(folder / "grid.png")
            (folder / PROMPTS_FILE).write_text(json.dumps({"step": step, "prompts": index}, indent=1))
            record["grid"] = str((folder / "grid.png").relative_to(self.run_dir.path))
        return record

    # ---- the frozen components

    def _encode_prompts(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """{text: (hidden states [seq, d], pooled [p] or None)} for this rank's prompts and negative prompts, from the
        latent cache's text entries (computed there on a miss, the text encoders then released)."""
        texts = sorted({t for p in self.mine for t in (p.prompt, p.negative_prompt) if t})
        if not texts:
            return {}
        spec = DataSpec.from_config(self.cfg)
        cache = LatentCache(cache_dir(spec))
        seq_len = self.cfg.model.text_seq_len
        text_id = component_ids(self.paths, FileHasher(cache.root / "file_hashes.json"))["text"]
        keys = {t: LatentCache.text_key(t, text_id, seq_len) for t in texts}
        todo = [t for t in texts if not cache.has("text", keys[t])]
        if todo:
            encoders = FrozenEncoders(self.paths, _encode_device(self.cfg, self.device), self.cfg.model)
            try:
                hidden, pooled = encoders.encode_text(todo)
            finally:
                encoders.release()
            cache.put_texts([keys[t] for t in todo], todo, hidden, pooled)
        return {t: cache.get_text(keys[t]) for t in texts}

    def _vae_on_device(self) -> Any:
        if self._vae is None:
            from diffusers import AutoencoderKL

            with transformers_zero3_lifted():
                self._vae = AutoencoderKL.from_pretrained(self.paths.vae, local_files_only=True,
                                                          torch_dtype=self.dtype).eval()
        return self._vae.to(self.device)

    def _vae_off_device(self) -> None:
        """The VAE back on the host and the allocator's cache emptied: the step's memory is what it was."""
        if self._vae is not None:
            self._vae.to("cpu")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _encode_device(cfg: Config, device: torch.device) -> torch.device:
    choice = cfg.data.cache_device if cfg.data.name == "folder" else "auto"
    return device if choice == "auto" else torch.device(choice)


def _error(exc: BaseException, rank: int, weights: str | None) -> dict:
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    return {"type": type(exc).__name__, "message": str(exc)[:500], "rank": rank, "weights": weights,
            "out_of_memory": oom}


def _grid(rows: list[list[Any]]) -> Any:
    """A row per prompt, a column per weights; cells as large as the largest image (prompts may differ in size)."""
    from PIL import Image

    width = max(im.width for row in rows for im in row)
    height = max(im.height for row in rows for im in row)
    columns = max(len(row) for row in rows)
    grid = Image.new("RGB", (width * columns, height * len(rows)), "white")
    for r, row in enumerate(rows):
        for c, im in enumerate(row):
            grid.paste(im, (c * width, r * height))
    return grid


def make_validator(cfg: Config, run_dir: RunDir, logger: RunLogger, device: torch.device, dtype: torch.dtype,
                   rank: int, world: int) -> tuple[Validator | None, dict | None]:
    """(the run's Validator or None, what stopped it from being made or None). Preflight has checked the prompts;
    a prompt file changed since, or components that fail to load, are recorded and the run goes on without
    validation, unless validation.strict."""
    if not enabled(cfg):
        return None, None
    try:
        prompts = check_validation(cfg)
        validator = Validator(cfg, prompts, run_dir, logger, device, dtype, rank, world)
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        if cfg.validation.strict:
            raise
        log.warning("validation is off for this run: %s", exc)
        return None, {"type": type(exc).__name__, "message": str(exc)[:500], "key": getattr(exc, "key", None)}
    return validator, None


def validation_record(validator: Validator | None, error: dict | None, plan: Plan | None,
                      phases: Sequence[MeasuredPhase]) -> dict | None:
    """summary.json's `validation` (`error`: make_validator's); None for a run without validation prompts."""
    if error is not None:
        return {"error": error, "passes": []}
    if validator is None:
        return None
    return {**validator.summary(), "memory": phase_memory(plan, phases)}


def phase_memory(plan: Plan | None, phases: Sequence[MeasuredPhase]) -> dict:
    """The planner's sampling phase and the largest measured pass: on CUDA the allocator's reserved peak, which the
    planned reserved figure predicts; on a CPU no device figure (None), and the host RSS rise over the steps' peak
    beside the plan's sampling_pass_terms."""
    planned = next((p for p in plan.phases if p.phase == "sampling"), None) if plan else None
    added = plan.sampling_pass_terms if plan and "sampling_pass_terms" in plan else None
    passes = [r for r in phases if r["phase"] == "sampling"]
    steps = [r for r in phases if r["phase"] == "step"]
    reserved = largest(r["gpu_max_reserved_mib"] for r in passes)
    host = largest(r["host_peak_rss_mib"] for r in passes)
    step_host = largest(r["host_peak_rss_mib"] for r in steps)
    planned_reserved: float | None = planned.reserved_mib if planned else None
    out = {"planned_reserved_mib": planned_reserved,
           "planned_pass_mib": mib_of(added) if added is not None else None,
           "planned_pass_terms": {t.term: t.mib for t in added or ()},
           "measured_gpu_max_reserved_mib": reserved,
           "measured_gpu_max_allocated_mib": largest(r["gpu_max_allocated_mib"] for r in passes),
           "measured_host_peak_rss_mib": host, "steps_host_peak_rss_mib": step_host,
           "host_rss_rise_mib": host - step_host if host is not None and step_host is not None else None}
    out["gpu_measured_over_planned"] = reserved / planned_reserved if reserved is not None and planned_reserved else None
    return out

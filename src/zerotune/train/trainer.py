"""The training loop (accelerate + DeepSpeed, no framework; reads top to bottom), its console progress (a live bar
on a terminal, plain periodic lines elsewhere), and fault injection (`debug.*`): `step_hook` is None unless a
debug key is set, and the loop then runs no fault code at all."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
from accelerate.utils import set_seed

from zerotune.config.schema import Debug
from zerotune.data import build_loader
from zerotune.data.components import resolve_components
from zerotune.data.spec import DataSpec
from zerotune.host.process import pause
from zerotune.models import adapter, build_network, diffusion, text_encoders
from zerotune.models.backbones import backbone_of
from zerotune.models.diffusion import objective_of
from zerotune.plan.resolve import ResolvedRun
from zerotune.rundir import RunDir, checkpoint_io, resume
from zerotune.rundir.checkpoint_io import RunSaves
from zerotune.rundir.loggers import RunLogger
from zerotune.train import distributed
from zerotune.train.engine import (
    HostEMA,
    make_accelerator,
    optimizer_and_scheduler,
    partition_bytes,
    zero3_init,
)
from zerotune.train.rungs import PRUNED, TrialRungs
from zerotune.train.validation import make_validator

log = logging.getLogger("zerotune")


def _fmt(row: dict) -> dict:
    mem = row.get("memory/gpu_process_mib")
    host = row.get("memory/host_rss_mib")
    return {"loss": f"{row['loss/train']:.4f}", "s/it": f"{row['perf/step_time_s']:.3f}",
            "host": f"{host:.0f}MiB" if host is not None else "-",
            "gpu": f"{mem:.0f}MiB" if mem is not None else "-"}


class Progress:
    def __init__(self, total: int, enabled: bool, every: int = 25, stream=None):
        self.total, self.enabled, self.every = total, enabled, max(every, 1)
        stream = stream or sys.stderr
        self.bar = None
        if enabled and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", file=stream, dynamic_ncols=True)

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(_fmt(row), refresh=False)
            self.bar.update(1)
        elif row["step"] % self.every == 0 or row["step"] in (1, self.total):
            f = _fmt(row)
            log.info("step %d/%d  loss %s  %s s/it  host %s  gpu %s", row["step"], self.total, f["loss"],
                     f["s/it"], f["host"], f["gpu"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


log = logging.getLogger(__name__)

KEYS = ("fail_at_step", "oom_at_step", "hang_at_step", "kill_at_step", "host_alloc_mib")


def step_hook(debug: Debug, rank: int) -> Callable[[int], None] | None:
    """A function called before each step (with the steps done so far), or None when nothing is injected."""
    if not any(getattr(debug, k) is not None for k in KEYS):
        return None
    if debug.fail_rank is not None and int(debug.fail_rank) != rank:
        return None  # faults are injected on that rank only (null: every rank)

    def inject(step: int) -> None:
        if debug.fail_at_step == step:
            raise RuntimeError(f"debug.fail_at_step={step}: injected failure")
        if debug.oom_at_step == step:
            raise torch.OutOfMemoryError(f"debug.oom_at_step={step}: injected out of memory")
        if debug.hang_at_step == step:
            log.warning("debug.hang_at_step=%d: hanging", step)
            threading.Event().wait()
        if debug.kill_at_step == step:
            log.warning("debug.kill_at_step=%d: killing this rank (SIGKILL)", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if debug.host_alloc_mib and step == 1:
            # A known allocation, touched page by page and held for 3 s (many samples even on a busy machine),
            # for the host-peak honesty check.
            ballast = torch.ones(int(debug.host_alloc_mib) * 2**20 // 4, dtype=torch.float32)
            threading.Event().wait(3.0)
            del ballast

    return inject




class Trainer:
    def __init__(self, resolved: ResolvedRun, run_dir: RunDir, logger: RunLogger, phases=None):
        """`phases`: the run's PhaseTimeline (host/torch_memory.py), told when data=folder's caching starts."""
        self.resolved, self.run_dir, self.logger = resolved, run_dir, logger
        self.cfg = cfg = resolved.config
        self._phases = phases
        ds = resolved.ds_config
        self.micro_batch, self.grad_accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        self.clip = float(ds.get("gradient_clipping", 0.0))
        self.resume_decision = resolved.resume  # found, checked and judged in preflight
        self.accelerator = make_accelerator(resolved, cfg.launch.collective_timeout_s)
        self._clean_stale_swap()
        seed = cfg.train.seed
        set_seed(seed)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.kind = cfg.model.conditioning
        self.backbone = backbone_of(cfg.model)
        self.objective = objective_of(cfg.model, cfg.diffusion)
        self.noise_schedule = self.objective.schedule
        # Shuffling, noise and dropout draw from their own seeded generators; the noise one is the same on every
        # rank, which keeps its slice of the global batch's draws (distributed.global_batch_draws).
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.gen = torch.Generator().manual_seed(seed * 7919)
        self._prepare(seed)
        ema, self.ema = cfg.ema, None
        if ema.enabled:
            self.ema = HostEMA(self._trained_named_parameters(), ema.decay, ema.warmup, zero3=resolved.zero_stage == 3)
        self.step, self.samples_seen, self.epoch = 0, 0, 0
        self.batches_in_epoch, self._skip = 0, 0
        self._epoch_gen_states: list[torch.Tensor] = []
        self._batches = self._infinite_batches()
        self.saves = RunSaves(cfg.checkpoint, run_dir.path, self.resume_decision)
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.stopped_by: str | None = None
        self.partition: dict | None = None
        self.logged_losses: dict[int, float] = {}
        if self.resume_decision is not None:
            self._restore(self.resume_decision)
        self.validator, self.validation_error = make_validator(cfg, run_dir, logger, self.accelerator.device,
                                                               self.dtype, self.rank, self.world)

    def _prepare(self, seed: int) -> None:
        """The trained modules (the U-Net, and any text encoder model.train_text_encoder names), their data,
        optimizer and scheduler, handed to accelerate (and DeepSpeed) as one module: one engine partitions all."""
        cfg = self.cfg
        # ZeRO-3: built partitioned (zero.Init), from the same seeded RNG stream as the other stages' plain build.
        unet = build_network(cfg.model, zero_init=zero3_init(self.accelerator, self.resolved))
        unet = adapter.add_adapter(unet, cfg.adapter)  # adapter=none: unchanged
        if cfg.train.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        module = self._with_text_encoders(unet)
        self.trains_text = module is not unet
        caching = self._phases is not None and cfg.data.name == "folder"
        if caching:  # latents and text embeddings, the encoders on data.cache_device (data/prepare.py)
            self._phases.begin("caching")
        loader = build_loader(DataSpec.from_config(cfg), self.micro_batch, seed, run_dir=self.run_dir.path)
        if caching:
            self._phases.begin("loading")
        self.data_report = getattr(loader.dataset, "report", None)  # data=folder: what was used and skipped
        lrs = text_encoders.group_lrs(cfg.model, cfg.optimizer.lr)
        groups = text_encoders.param_groups(module, lrs, self.resolved.group_layout())
        opt, sched = optimizer_and_scheduler(self.resolved, groups)
        pause("engine_build")
        if sched is None:
            self.unet, self.optimizer, self.loader = self.accelerator.prepare(module, opt, loader)
            self.scheduler = None
        else:
            self.unet, self.optimizer, self.loader, self.scheduler = self.accelerator.prepare(
                module, opt, loader, sched)
        self.dtype = next(self.unet.parameters()).dtype
        if torch.cuda.is_available():
            # What the engine's build freed (ZeRO-1/2's last parameter group's blocks and clone) stays reserved, in
            # nvidia-smi, through training unless returned here; the step allocates its own afresh.
            torch.cuda.empty_cache()

    def _with_text_encoders(self, unet: torch.nn.Module) -> torch.nn.Module:
        """The U-Net alone, or with the text encoders model.train_text_encoder trains (loaded from the components)."""
        names = text_encoders.trained(self.cfg.model)
        if not names:
            return unet
        paths = resolve_components(self.cfg.model)
        folders = {"text_encoder": paths.text_encoder, "text_encoder_2": paths.text_encoder_2}
        encoders = {}
        for name in names:
            folder = folders[name]
            assert folder is not None  # resolve_components finds every encoder the model's conditioning has
            encoders[name] = text_encoders.load(name, folder, self.cfg.adapter, self.cfg.train.gradient_checkpointing)
        return text_encoders.UNetWithTextEncoders(unet, encoders, pooled=self.kind == "text_time",
                                                  first_width=text_encoders.first_width(self.cfg.model))

    def _trained_named_parameters(self) -> list:
        """What the optimizer updates (and the EMA averages): the adapter's weights under adapter=lora; named as
        the engine's module names them (`unet.`, `text_encoder.` ... when text encoders train)."""
        return [(n, p) for n, p in self.trained_module().named_parameters() if p.requires_grad]

    def _encoders(self) -> dict[str, torch.nn.Module]:
        """The trained text encoders by name (none unless model.train_text_encoder names some)."""
        module = self.trained_module()
        return module.encoders() if isinstance(module, text_encoders.UNetWithTextEncoders) else {}

    def optimizer_class(self) -> str:
        """The class that applies the updates: DeepSpeed's engine keeps it as `basic_optimizer`."""
        inner = getattr(self.unet, "basic_optimizer", None) if self.resolved.use_deepspeed else None
        inner = inner or getattr(self.optimizer, "optimizer", self.optimizer)
        return type(inner).__name__

    def trained_module(self) -> torch.nn.Module:
        """The engine's module, unwrapped: the U-Net, or the U-Net with its trained text encoders."""
        return self.accelerator.unwrap_model(self.unet)

    def unet_module(self) -> torch.nn.Module:
        module = self.trained_module()
        return module.unet if isinstance(module, text_encoders.UNetWithTextEncoders) else module

    def _infinite_batches(self):
        while True:
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(self.epoch)
            # The shuffle generators as this epoch starts: restoring them replays its order on resume.
            self._epoch_gen_states = [g.get_state() for g in self._loader_generators()]
            loader = self.loader
            if self._skip:
                loader, self._skip = self.accelerator.skip_first_batches(self.loader, self._skip), 0
            for batch in loader:
                self.batches_in_epoch += 1
                yield batch
            self.epoch, self.batches_in_epoch = self.epoch + 1, 0

    def _loader_generators(self) -> list[torch.Generator]:
        from accelerate.data_loader import get_sampler

        found = [getattr(self.loader, "generator", None), getattr(get_sampler(self.loader), "generator", None),
                 getattr(getattr(self.loader, "batch_sampler", None), "generator", None)]
        unique: list[torch.Generator] = []
        for g in found:
            if isinstance(g, torch.Generator) and all(g is not u for u in unique):
                unique.append(g)
        return unique

    # ---- checkpoints (the files and their rules: checkpoints/)

    def position_state(self) -> dict:
        """Where training stands, per rank: step, data position, the Trainer's own generators."""
        return {"step": self.step, "samples_seen": self.samples_seen, "epoch": self.epoch,
                "batches_in_epoch": self.batches_in_epoch, "gen": self.gen.get_state(),
                "epoch_gen_states": self._epoch_gen_states}

    def load_position_state(self, state: dict, saved_world: int, world: int) -> None:
        self.step, self.samples_seen, self.epoch = state["step"], state["samples_seen"], state["epoch"]
        self.gen.set_state(state["gen"])
        gens = self._loader_generators()
        if len(gens) == len(state["epoch_gen_states"]):
            for g, s in zip(gens, state["epoch_gen_states"], strict=True):
                g.set_state(s)
        # Skip exactly the batches this epoch consumed (the same samples when the process count changed).
        self._skip = state["batches_in_epoch"] * saved_world // world
        self.batches_in_epoch = self._skip

    def _restore(self, decision: resume.ResumeDecision) -> None:
        raw_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if self.resolved.use_deepspeed:
            raw_scheduler = getattr(self.unet, "lr_scheduler", None)
        else:
            raw_scheduler = getattr(self.scheduler, "scheduler", self.scheduler)
        position, ema = checkpoint_io.load(self.accelerator, decision, self.trained_module(), raw_optimizer,
                                    raw_scheduler)
        self.load_position_state(position, decision.meta["world_size"], self.accelerator.num_processes)
        if self.ema is not None and ema is not None:
            self.ema.load_state_dict(ema)

    def _clean_stale_swap(self) -> None:
        """Resuming with NVMe offload: a killed run's swap folders go first (only inside offload.path)."""
        if self.resume_decision is not None and self.cfg.offload.device == "nvme":
            if self.accelerator.is_local_main_process:
                removed = checkpoint_io.clean_stale_swap(str(self.resolved.nvme_dir))
                log.info("removed stale DeepSpeed swap folders: %s", removed)
            self.accelerator.wait_for_everyone()

    def save_checkpoint(self) -> None:
        self.saves.save(self.accelerator, self.step, lambda: checkpoint_io.SaveRequest(
            root=self.saves.root, step=self.step,
            meta=resume.current_meta(self.cfg, self.resolved.ds_config, self.resolved.use_deepspeed, self.world,
                                           self.resolved.client_optimizer, self.resolved.param_groups),
            position_state=self.position_state(), unet=self.unet_module(), job=self.saves.job,
            encoder_configs={n: m.config for n, m in self._encoders().items()},
            # fp32 weights, and Adam's two moments of the trained ones
            size_estimate=self.resolved.model_stats.num_params * 4 + self.resolved.model_stats.num_trainable * 8,
            ema_state=self.ema.state_dict() if self.ema is not None else None,
            keep_last=self.cfg.checkpoint.keep_last))

    def forward_backward(self, batch: dict) -> float:
        dev = self.accelerator.device
        batch = {k: (v.to(dev, self.dtype) if v.is_floating_point() else v.to(dev)) for k, v in batch.items()}
        diff = self.cfg.diffusion
        p = diff.cond_dropout
        draws = distributed.global_batch_draws(self.gen, tuple(batch["x0"].shape), self.rank, self.world, 0, p,
                                               noise_offset=diff.noise_offset,
                                               draw_timesteps=self.objective.draw_timesteps)
        if self.trains_text:  # the condition is encoded inside the engine's module, then dropped there
            drop = draws["uniform"] < p if draws["uniform"] is not None else None
            cond = {"batch": batch, "drop": drop}
        else:
            cond = diffusion.unet_kwargs(self.kind, diffusion.drop_condition(
                self.kind, batch, p, self.gen, uniform=draws["uniform"]))
        def predict(noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return self.backbone.predict(self.unet, noisy.to(self.dtype), t, cond, diff.guidance_scale)

        loss = self.objective.loss(predict, batch["x0"], draws["noise"], draws["timesteps"], batch.get("mask"))
        self.accelerator.backward(loss)
        return float(loss.detach())

    def train_step(self) -> dict:
        """One optimizer step over `grad_accum` micro batches; returns its training metrics."""
        losses, grad_norm = [], None
        for _ in range(self.grad_accum):
            with self.accelerator.accumulate(self.unet):
                losses.append(self.forward_backward(next(self._batches)))
                if self.accelerator.sync_gradients:
                    norm = self.accelerator.clip_grad_norm_(self.unet.parameters(), self.clip or math.inf)
                    grad_norm = None if norm is None else float(norm)
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self._trained_named_parameters())
        self.step += 1
        self.samples_seen += self.micro_batch * self.grad_accum * self.accelerator.num_processes
        return {"loss/train": sum(losses) / len(losses), "train/lr": float(self.optimizer.param_groups[0]["lr"]),
                "train/grad_norm": grad_norm, "train/samples_seen": self.samples_seen, "train/epoch": self.epoch}

    def full_state_dict(self, use_ema: bool) -> dict:
        """Whole fp32 weights on the CPU; a collective under ZeRO-3, so every rank calls it."""
        state = self.accelerator.get_state_dict(self.unet)
        state = {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}
        if use_ema and self.ema is not None:  # the averaged weights: all of them, or the adapter's over the base
            state.update({k: v.clone() for k, v in self.ema.shadow.items()})
        return state

    def log_row(self, row: dict) -> None:
        """One logged step: to metrics.jsonl and to the logger, under the same keys."""
        if self.partition is None:
            # This rank's ZeRO share, once the optimizer's partitions exist (after the first step).
            self.partition = partition_bytes(self.unet, self.optimizer)
        self.logged_losses[int(row["step"])] = row["loss/train"]  # every rank's, for cross-rank checks
        self.run_dir.log_metrics(row)
        self.logger.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def fit(self, telemetry, stop) -> dict:
        """Train for train.max_steps, or until a stop signal (`stop`: train/distributed.py); returns progress()."""
        max_steps, every = self.cfg.train.max_steps, self.cfg.train.log_every
        progress = Progress(max_steps, enabled=self.accelerator.is_main_process, every=every)
        inject_faults = step_hook(self.cfg.debug, self.rank)  # None unless debug.* is set
        trial, rungs = self.cfg.trial, None
        if trial is not None and trial.storage:  # a tune trial: its study may stop it at a rung
            rungs = TrialRungs(trial, self.accelerator.is_main_process)
        validator = self.validator
        try:
            if validator is not None and validator.due_at_start(self.step):
                self._validate()
            while self.step < max_steps:
                self.stopped_by = stop.agreed(self.accelerator.device)
                if self.stopped_by is not None:
                    if self.cfg.checkpoint.on_signal and self.step > 0:
                        self.save_checkpoint()
                    break
                if inject_faults is not None:
                    inject_faults(self.step)
                row = self._timed_step(telemetry)
                if self.step % every == 0 or self.step in (1, max_steps):
                    self.log_row(row)
                progress.update(row)
                if rungs is not None and rungs.stop_here(self.step, telemetry.timer):
                    self.stopped_by = PRUNED
                    break
                if self.saves.due(self.step):
                    self.save_checkpoint()
                if validator is not None and validator.due(self.step, max_steps):
                    self._validate()
            # Only a run that completed its steps: a failure never gets here (its state may be what broke it,
            # and a save is a collective a failed rank cannot join); a stop saves per checkpoint.on_signal.
            if self.stopped_by is None:
                self.saves.save_final(self.step, self.save_checkpoint)
                if validator is not None and validator.due_at_end(self.step):  # after the save: nothing to lose
                    self._validate(then_train=False)
        finally:
            progress.close()
        return self.progress()

    def _validate(self, then_train: bool = True) -> None:
        """A validation pass, timed as the run's sampling phase (host/torch_memory.py) between training steps."""
        assert self.validator is not None
        if self._phases is not None:
            self._phases.begin("sampling")
        self.validator.run(self.step, self)
        if self._phases is not None and then_train:
            self._phases.begin("step")

    def _timed_step(self, telemetry) -> dict:
        telemetry.timer.start_step()
        metrics = self.train_step()
        step_s = telemetry.timer.end_step(self.micro_batch * self.grad_accum * self.accelerator.num_processes)
        loss = self.loss_last = float(metrics["loss/train"])
        self.loss_first = loss if self.loss_first is None else self.loss_first
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {self.step}")
        return {"step": self.step, **metrics, "perf/step_time_s": step_s, **telemetry.step_memory()}

    def progress(self) -> dict:
        """How far training got: the summary's part, also when it failed or was stopped."""
        return {"steps": self.step, "loss_first": self.loss_first, "loss_last": self.loss_last,
                "samples_seen": self.samples_seen, "epochs": self.epoch, "checkpoint": self.saves.summary()}

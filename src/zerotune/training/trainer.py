"""The training loop: accelerate + DeepSpeed, no framework. Reads top to bottom."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch
from accelerate.utils import set_seed

from zerotune.data import build_loader
from zerotune.diffusion import diffusion_loss, noise_scheduler
from zerotune.models import build_unet, conditioning
from zerotune.plan import Plan
from zerotune.training.backend import make_accelerator, optimizer_and_scheduler
from zerotune.training.ema import HostEMA
from zerotune.training.progress import Progress

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Any, plan: Plan, metrics_sink):
        self.cfg, self.plan, self.metrics_sink = cfg, plan, metrics_sink
        ds = plan.ds_config
        self.micro_batch, self.grad_accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        self.clip = float(ds.get("gradient_clipping", 0.0))
        self.accelerator = make_accelerator(plan)
        seed = int(cfg.train.seed)
        set_seed(seed)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        unet = build_unet(cfg.model)
        if cfg.train.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        self.kind = cfg.model.conditioning
        self.noise = noise_scheduler(cfg.diffusion)
        # Shuffling, noise and condition dropout draw from their own seeded generators, one stream per rank.
        rank = self.accelerator.process_index
        loader = build_loader(cfg, self.micro_batch, seed)
        self.gen = torch.Generator().manual_seed(seed * 7919 + rank)
        opt, sched = optimizer_and_scheduler(plan, unet.parameters())
        if sched is None:
            self.unet, self.optimizer, self.loader = self.accelerator.prepare(unet, opt, loader)
            self.scheduler = None
        else:
            self.unet, self.optimizer, self.loader, self.scheduler = self.accelerator.prepare(
                unet, opt, loader, sched)
        self.dtype = next(self.unet.parameters()).dtype
        self.ema = None
        if cfg.ema.enabled:
            self.ema = HostEMA(list(self._module().named_parameters()), cfg.ema.decay, cfg.ema.warmup,
                               zero3=self.zero_stage == 3)
        self.step, self.samples_seen, self.epoch = 0, 0, 0
        self._batches = self._infinite_batches()

    @property
    def zero_stage(self) -> int:
        return int(self.plan.ds_config["zero_optimization"]["stage"]) if self.plan.use_deepspeed else 0

    def _module(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.unet)

    def _infinite_batches(self):
        while True:
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(self.epoch)
            yield from self.loader
            self.epoch += 1

    def _to_device(self, batch: dict) -> dict:
        dev = self.accelerator.device
        return {k: (v.to(dev, self.dtype) if v.is_floating_point() else v.to(dev)) for k, v in batch.items()}

    def forward_backward(self, batch: dict) -> float:
        batch = self._to_device(batch)
        cond = conditioning.drop_condition(self.kind, batch, float(self.cfg.diffusion.cond_dropout), self.gen)
        loss = diffusion_loss(self.unet, batch["x0"], conditioning.unet_kwargs(self.kind, cond), self.noise,
                              self.gen, self.dtype)
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
            self.ema.update(self._module().named_parameters())
        self.step += 1
        self.samples_seen += self.micro_batch * self.grad_accum * self.accelerator.num_processes
        return {"loss/train": sum(losses) / len(losses), "train/lr": self.current_lr(),
                "train/grad_norm": grad_norm, "train/samples_seen": self.samples_seen, "train/epoch": self.epoch}

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self, use_ema: bool) -> dict:
        """Whole fp32 weights on the CPU; a collective under ZeRO-3, so every rank calls it."""
        if use_ema and self.ema is not None:
            return {k: v.clone() for k, v in self.ema.shadow.items()}
        state = self.accelerator.get_state_dict(self.unet)
        return {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}

    def _inject_faults(self) -> None:
        debug = self.cfg.get("debug") or {}
        if debug.get("fail_at_step") == self.step:
            raise RuntimeError(f"debug.fail_at_step={self.step}: injected failure")
        if debug.get("oom_at_step") == self.step:
            raise torch.OutOfMemoryError(f"debug.oom_at_step={self.step}: injected out of memory")
        if debug.get("hang_at_step") == self.step:
            log.warning("debug.hang_at_step=%d: hanging", self.step)
            threading.Event().wait()

    def fit(self, telemetry) -> dict:
        """Train for train.max_steps; returns the loss/perf part of the summary."""
        max_steps, every = int(self.cfg.train.max_steps), int(self.cfg.train.log_every)
        progress = Progress(max_steps, enabled=self.accelerator.is_main_process, every=every)
        loss_first = loss_last = None
        try:
            while self.step < max_steps:
                self._inject_faults()
                telemetry.timer.start_step()
                metrics = self.train_step()
                step_s = telemetry.timer.end_step(self.micro_batch * self.grad_accum * self.accelerator.num_processes)
                loss_last = metrics["loss/train"]
                loss_first = loss_last if loss_first is None else loss_first
                if not math.isfinite(loss_last):
                    raise FloatingPointError(f"loss is {loss_last} at step {self.step}")
                row = {"step": self.step, **metrics, "perf/step_time_s": step_s, **telemetry.step_memory()}
                if self.step % every == 0 or self.step in (1, max_steps):
                    self.metrics_sink.log_metrics(row)
                progress.update(row)
        finally:
            progress.close()
        return {"steps": self.step, "loss_first": loss_first, "loss_last": loss_last,
                "samples_seen": self.samples_seen, "epochs": self.epoch}

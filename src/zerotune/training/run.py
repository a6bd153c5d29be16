"""One training run, start to finish: plan, run directory, train, evaluate, summary."""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from zerotune.errors import ConfigError
from zerotune.plan import make_plan
from zerotune.rundir import RunDir
from zerotune.telemetry import environment_info
from zerotune.telemetry.plot import plot_run
from zerotune.training import distributed

log = logging.getLogger("zerotune")


def key_choices(cfg: Any) -> dict:
    """The few choices that identify a configuration in reports and dashboards."""
    return {"zero_stage": int(cfg.zero_stage.stage), "offload": cfg.offload.device,
            "optimizer": cfg.optimizer.name, "scheduler": cfg.scheduler.name,
            "resolution": int(cfg.resolution.size), "batch_size": int(cfg.train.batch_size),
            "grad_accum": int(cfg.train.grad_accum), "precision": cfg.precision.name, "model": cfg.model.name,
            "data": cfg.data.name, "gradient_checkpointing": bool(cfg.train.gradient_checkpointing),
            "world_size": distributed.world_size()}


def train(cfg: Any, output_dir: str) -> dict:
    """Train as `cfg` says, writing everything into `output_dir`; returns the summary written there.

    A ConfigError is re-raised after its summary is written: bad input never reaches model building.
    """
    start = time.time()
    distributed.ensure_single_process_env()
    run_dir = RunDir(output_dir, is_writer=distributed.rank() == 0)
    run_dir.write_config(cfg)
    summary: dict = {"status": "failed", "choices": key_choices(cfg), "run_dir": str(run_dir.path)}
    try:
        plan = make_plan(cfg, distributed.world_size())
        run_dir.write_ds_config(plan.ds_config)
        summary.update({"use_deepspeed": plan.use_deepspeed, "num_params": plan.model_stats.num_params})
        summary.update(_train_and_evaluate(cfg, plan, run_dir))
        summary["status"] = "ok"
        return summary
    except ConfigError as exc:
        summary["error"] = {"type": "ConfigError", "key": exc.key, "message": str(exc)}
        raise
    except BaseException as exc:
        summary["error"] = {"type": type(exc).__name__, "message": str(exc),
                            "traceback_tail": traceback.format_exc().splitlines()[-12:]}
        raise
    finally:
        summary["wall_time_s"] = time.time() - start
        summary["env"] = environment_info()
        run_dir.write_summary(summary)
        run_dir.close()
        if run_dir.is_writer and run_dir.file("metrics.jsonl").is_file():
            plot_run(run_dir.file("metrics.jsonl"), run_dir.file("telemetry.png"))


def _train_and_evaluate(cfg: Any, plan, run_dir: RunDir) -> dict:
    from zerotune.training.evaluate import evaluate_digits
    from zerotune.training.measure import RunTelemetry
    from zerotune.training.trainer import Trainer

    nvme = cfg.offload.path if cfg.offload.device == "nvme" else None
    out: dict = {}
    with RunTelemetry(nvme_dir=nvme) as telemetry:
        trainer = Trainer(cfg, plan, run_dir)
        telemetry.timer.synchronize = _device_sync(trainer)
        out.update(trainer.fit(telemetry))
        out["train_time_s"] = sum(telemetry.timer.durations)
        if trainer.ema is not None:
            out["ema"] = {"host_mib": trainer.ema.host_bytes() / 2**20, "updates": trainer.ema.updates}
    out.update(telemetry.summary())
    if cfg.evaluate.enabled and cfg.model.conditioning == "class" and cfg.data.name == "digits":
        quality = evaluate_digits(trainer, cfg, run_dir)
        if quality is not None:
            out["quality"] = quality
    trainer.accelerator.end_training()
    return out


def _device_sync(trainer):
    device = trainer.accelerator.device
    if device.type == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None  # CPU work is synchronous


def print_result(summary: dict) -> None:
    q = summary.get("quality", {})
    perf = summary.get("perf", {})
    parts = [f"status {summary['status']}", f"steps {summary.get('steps')}",
             f"loss {summary.get('loss_first') or float('nan'):.4f} -> {summary.get('loss_last') or float('nan'):.4f}"]
    if perf.get("step_time_median_s") is not None:
        parts.append(f"{perf['step_time_median_s']:.3f} s/step (median)")
    if "digit_accuracy" in q:
        parts.append(f"digit accuracy {100 * q['digit_accuracy']:.1f}%")
    parts.append(f"wall time {summary['wall_time_s']:.0f} s")
    log.info("result: %s", ", ".join(parts))
    log.info("run directory: %s", summary["run_dir"])

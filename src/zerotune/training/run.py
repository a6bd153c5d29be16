"""One training process, start to finish: plan, train, evaluate, summary. Every rank runs this."""

from __future__ import annotations

import json
import logging
import time
import traceback
from typing import Any

from zerotune.errors import ConfigError
from zerotune.launch.spec import JobSpec
from zerotune.loggers import make_logger
from zerotune.loggers.base import NullLogger, RunLogger
from zerotune.plan import make_plan
from zerotune.rundir import RunDir, write_json_atomic
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


def experiment_info(cfg: Any) -> dict | None:
    """An experiment's name and the reference figures it reproduces, for reports to compare against."""
    ref = cfg.get("reference")
    if not ref:
        return None
    from omegaconf import OmegaConf

    return {"name": ref.get("name"), "reference": OmegaConf.to_container(ref, resolve=True)}


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def train(cfg: Any, spec: JobSpec) -> dict:
    """Train as `cfg` says, in `spec.run_dir`; returns the summary rank 0 writes there.

    A ConfigError is re-raised after its summary is written: bad input never reaches model building.
    """
    start = time.time()
    distributed.ensure_single_process_env()
    rank = distributed.rank()
    run_dir = RunDir(spec.run_dir, is_writer=rank == 0)
    run_dir.write_config(cfg)
    summary: dict = {"status": "failed", "choices": key_choices(cfg), "run_dir": str(run_dir.path),
                     "experiment": experiment_info(cfg)}
    logger: RunLogger = NullLogger()
    try:
        plan = make_plan(cfg, distributed.world_size(), overrides=spec.overrides)
        run_dir.write_config(cfg)  # now with the user's files folded in
        # After the plan: W&B's run config is the effective one, the user's DeepSpeed/accelerate files included.
        logger = make_logger(cfg, spec.run_dir, spec.run_name, spec.group, is_main=rank == 0)
        distributed.init_accelerate_state(plan.use_deepspeed)
        run_dir.write_ds_config(plan.ds_config)
        summary.update({"choices": key_choices(cfg), "config_sources": plan.config_sources,
                        "use_deepspeed": plan.use_deepspeed, "num_params": plan.model_stats.num_params})
        summary.update(_train_and_evaluate(cfg, plan, run_dir, logger))
        summary["status"] = "ok"
        return summary
    except ConfigError as exc:
        summary["error"] = {"type": "ConfigError", "key": exc.key, "message": str(exc)}
        raise
    except BaseException as exc:
        summary["status"] = "oom" if is_oom(exc) else "failed"
        summary["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                            "traceback_tail": traceback.format_exc().splitlines()[-12:]}
        raise
    finally:
        summary["wall_time_s"] = time.time() - start
        summary["env"] = environment_info()
        run_dir.write_summary(summary)
        run_dir.close()
        if run_dir.is_writer and run_dir.file("metrics.jsonl").is_file():
            plot_run(run_dir.file("metrics.jsonl"), run_dir.file("telemetry.png"))
        _finish_logger(logger, summary, run_dir)


def _finish_logger(logger, summary: dict, run_dir: RunDir) -> None:
    images = [p for p in (run_dir.file("samples/grid.png"), run_dir.file("telemetry.png")) if p.is_file()]
    if images:
        logger.log_images("samples", [str(p) for p in images], step=int(summary.get("steps") or 0))
    logger.log_summary({k: v for k, v in summary.items() if k != "env"})
    logger.finish(0 if summary["status"] == "ok" else 1)


def _train_and_evaluate(cfg: Any, plan, run_dir: RunDir, logger) -> dict:
    from zerotune.training.evaluate import evaluate_digits
    from zerotune.training.measure import RunTelemetry
    from zerotune.training.trainer import Trainer

    nvme = cfg.offload.path if cfg.offload.device == "nvme" else None
    out: dict = {}
    with RunTelemetry(nvme_dir=nvme) as telemetry:
        trainer = Trainer(cfg, plan, run_dir, logger)
        telemetry.timer.synchronize = _device_sync(trainer)
        out.update(trainer.fit(telemetry))
        out["optimizer_class"] = trainer.optimizer_class()  # what stepped: e.g. DeepSpeedCPUAdam when offloaded
        out["train_time_s"] = sum(telemetry.timer.durations)
        if trainer.ema is not None:
            out["ema"] = {"host_mib": trainer.ema.host_bytes() / 2**20, "updates": trainer.ema.updates}
    out.update(telemetry.summary())
    if trainer.data_report:
        out["data"] = trainer.data_report
    out["partition"] = trainer.partition
    record = _write_rank_memory(run_dir, out["memory"], partition=trainer.partition, losses=trainer.logged_losses)
    # Every rank's record reaches rank 0 over torch.distributed (the nodes may share no file system).
    records = distributed.gather_object(record)
    if records is not None:
        out["memory"].update(_per_rank_memory(records))
    if cfg.evaluate.enabled and cfg.model.conditioning == "class" and cfg.data.name == "digits":
        quality = evaluate_digits(trainer, cfg, run_dir)
        if quality is not None:
            out["quality"] = quality
    trainer.accelerator.end_training()
    return out


def _write_rank_memory(run_dir: RunDir, memory: dict, **extra) -> dict:
    """Every rank records its own figures; the job merges them (rank 0 alone would hide the others)."""
    folder = run_dir.path / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": distributed.rank(), **memory, **extra}
    write_json_atomic(folder / f"rank{distributed.rank()}.json", record)
    return record


def _per_rank_memory(records: list[dict]) -> dict:
    from zerotune.launch.job import per_rank_summary

    return per_rank_summary(records)


def _device_sync(trainer):
    device = trainer.accelerator.device
    if device.type == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None  # CPU work is synchronous


def print_result(summary: dict) -> None:
    q, perf = summary.get("quality", {}), summary.get("perf", {})
    first, last = summary.get("loss_first"), summary.get("loss_last")
    parts = [f"status {summary['status']}", f"steps {summary.get('steps')}"]
    if first is not None and last is not None:
        parts.append(f"loss {first:.4f} -> {last:.4f}")
    if perf.get("step_time_median_s") is not None:
        parts.append(f"{perf['step_time_median_s']:.3f} s/step (median)")
    if "digit_accuracy" in q:
        parts.append(f"digit accuracy {100 * q['digit_accuracy']:.1f}%")
    parts.append(f"wall time {summary.get('wall_time_s', 0):.0f} s")
    log.info("result: %s", ", ".join(parts))
    if summary.get("error"):
        log.error("error: %s", json.dumps(summary["error"].get("message")))
    log.info("run directory: %s", summary["run_dir"])

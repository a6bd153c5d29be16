"""One training process, start to finish: checked, train, evaluate, summary. Every rank runs this."""

from __future__ import annotations

import logging
import time
import traceback
from contextlib import ExitStack

from zerotune import checkpoints
from zerotune.compose.settle import Settled
from zerotune.errors import ConfigError
from zerotune.loggers import make_logger
from zerotune.loggers.base import NullLogger, RunLogger
from zerotune.preflight import check
from zerotune.resolved import ResolvedRun
from zerotune.rundir import RunDir
from zerotune.rundir.run_summary import RunSummary
from zerotune.rundir.spec import JobSpec
from zerotune.rundir.status import Status
from zerotune.rundir.summary import experiment_info, is_oom, key_choices, per_rank_summary, write_rank_record
from zerotune.schema import Config
from zerotune.telemetry import environment_info, node_identity
from zerotune.telemetry.startup import gate_wait_s, startup_view
from zerotune.telemetry.timing import process_start_time
from zerotune.training import distributed
from zerotune.training.measure import RunTelemetry
from zerotune.training.rungs import PRUNED
from zerotune.training.stop import StopSignals
from zerotune.training.threads import apply_threads
from zerotune.training.trainer import Trainer
from zerotune.training.validation import validation_record

log = logging.getLogger("zerotune")


def train(run: ResolvedRun, spec: JobSpec, startup: dict | None = None) -> RunSummary:
    """Train the resolved `run` in `spec.run_dir`; returns the summary rank 0 writes there.

    A stop signal ends training after the current step, with the summary's status INTERRUPTED.
    """
    start = time.time()
    # telemetry/startup.py; `startup`: when this worker reached the job's gate and when it opened (launch/gate.py)
    marks = {"process_start": process_start_time(), **(startup or {}), "train_start": start}
    distributed.ensure_single_process_env()
    cfg, rank = run.config, distributed.rank()
    run_dir = RunDir(spec.run_dir, is_writer=rank == 0)
    summary = _initial_summary(run, run_dir)
    logger: RunLogger = NullLogger()
    with StopSignals() as stop, ExitStack() as held:
        try:
            summary.threads = apply_threads(cfg.launch)
            if not spec.from_parent and rank == 0:  # under torchrun & co. no zerotune parent holds it
                held.enter_context(checkpoints.job_lock(cfg.checkpoint, run_dir.path))
            # W&B's run config is the effective one, the user's DeepSpeed/accelerate files included.
            logger = make_logger(cfg, spec.run_dir, spec.run_name, spec.group, is_main=rank == 0)
            distributed.init_accelerate_state(run.use_deepspeed, cfg.launch.collective_timeout_s)
            _train_and_evaluate(run, run_dir, logger, stop, summary, marks)
            summary.status = summary.trained_status()
            return summary
        except ConfigError as exc:
            summary.error = {"type": "ConfigError", "key": exc.key, "message": str(exc)}
            raise
        except BaseException as exc:
            summary.status = Status.OOM if is_oom(exc) else Status.FAILED
            summary.error = {"type": type(exc).__name__, "message": str(exc)[:2000],
                             "traceback_tail": traceback.format_exc().splitlines()[-12:]}
            raise
        finally:
            summary.wall_time_s = time.time() - start
            # A tune trial is one measurement of many: its figures are in metrics.jsonl, and its plot would be
            # 0.16 s of each trial's few seconds.
            _close(summary, run_dir, logger, marks, plot=cfg.trial.storage is None)


def train_launched_externally(settled: Settled, spec: JobSpec) -> RunSummary:
    """Under torchrun / `accelerate launch` / `deepspeed` / `srun` with no zerotune parent, every rank runs
    this: rank 0 resolves the run (and writes config.yaml, ds_config.json, resolved.json), the other ranks
    receive it, and all train it. A refusal is recorded in summary.json (with config.yaml as settled) and
    raised on every rank."""
    try:
        run = _resolved_by_rank0(settled, spec)
    except ConfigError as exc:
        if distributed.rank() == 0:
            run_dir = RunDir(spec.run_dir)
            run_dir.write_config(settled.config)
            summary = _failed_summary(settled.config, run_dir)
            summary.error = {"type": "ConfigError", "key": exc.key, "message": str(exc)}
            summary.env = environment_info()
            run_dir.write_summary(summary)
        raise
    return train(run, spec)


def _resolved_by_rank0(settled: Settled, spec: JobSpec) -> ResolvedRun:
    run: ResolvedRun | None = None
    error: ConfigError | None = None
    if distributed.rank() == 0:
        try:
            run = check(settled, run_dir=spec.run_dir)
        except ConfigError as exc:
            error = exc
        else:
            run_dir = RunDir(spec.run_dir)
            run_dir.write_config(run.config)
            run_dir.write_ds_config(run.ds_config)
            run.save(spec.run_dir)
    if distributed.world_size() > 1:
        run, error = distributed.broadcast_object((run, error))
    if error is not None:
        raise error
    assert run is not None
    return run


def _failed_summary(cfg: Config, run_dir: RunDir) -> RunSummary:
    """What the summary says before training: failed until it is known otherwise."""
    return RunSummary.from_json({"status": Status.FAILED, "choices": key_choices(cfg, distributed.world_size()),
                                 "run_dir": str(run_dir.path), "experiment": experiment_info(cfg),
                                 "previous_attempts": run_dir.previous_attempts()})


def _initial_summary(run: ResolvedRun, run_dir: RunDir) -> RunSummary:
    """The summary before training, with what the resolution settled: the summary's choices and sources."""
    summary, stats = _failed_summary(run.config, run_dir), run.model_stats
    summary.update({"config_sources": run.config_sources, "config_warnings": list(run.config_warnings),
                    "use_deepspeed": run.use_deepspeed, "num_params": stats.num_params,
                    "trainable_params": stats.num_trainable, "frozen_params": stats.num_frozen})
    return summary


def _close(summary: RunSummary, run_dir: RunDir, logger: RunLogger, marks: dict, plot: bool) -> None:
    summary.startup_marks, summary.startup = marks, startup_view(None, marks)  # the parent adds its own
    summary.env = environment_info()
    run_dir.write_summary(summary)
    run_dir.close()
    if plot and run_dir.is_writer and run_dir.file("metrics.jsonl").is_file():
        # Imported here: matplotlib is half a second that no worker's start should wait on.
        from zerotune.telemetry.plot import plot_run

        plot_run(run_dir.file("metrics.jsonl"), run_dir.file("telemetry.png"))
    images = [p for p in (run_dir.file("samples/grid.png"), run_dir.file("telemetry.png")) if p.is_file()]
    if images:
        logger.log_images("samples", [str(p) for p in images], step=int(summary.steps or 0))
    logger.log_summary({k: v for k, v in summary.to_json().items() if k != "env"})  # as summary.json says it
    logger.finish(0 if summary.status == Status.OK else 1)


def _train_and_evaluate(run: ResolvedRun, run_dir: RunDir, logger: RunLogger, stop: StopSignals, summary: RunSummary,
                        marks: dict) -> None:
    """Train, then gather every rank's figures and evaluate, into `summary` (in place: what training got
    through is there even when it fails)."""
    cfg = run.config
    out = RunSummary()  # what this function adds to `summary`, merged once all of it is known
    # perf.startup_s leaves out the wait at the job's gate: a cold op build there is reported apart (startup.*),
    # so the first job of a sweep does not look slower than the next.
    with RunTelemetry(nvme_dir=run.nvme_dir, started=marks["process_start"] + gate_wait_s(marks)) as telemetry:
        telemetry.phases.begin("loading")
        trainer = Trainer(run, run_dir, logger, phases=telemetry.phases)
        marks["ready"] = time.time()
        telemetry.timer.synchronize = _device_sync(trainer)
        telemetry.phases.begin("step")
        try:
            out.update(trainer.fit(telemetry, stop))
        finally:
            telemetry.phases.end()
            summary.update(trainer.progress())
            marks["first_step_end"] = telemetry.timer.first_step_end_unix
        if trainer.stopped_by == PRUNED:  # a tune trial its study stopped at a rung
            out.pruned = {"after_step": trainer.step}
        elif trainer.stopped_by is not None:
            out.interrupted = {"signal": trainer.stopped_by, "after_step": trainer.step,
                               "last_checkpoint": (out.checkpoint or {}).get("last_complete")}
        out.optimizer_class = trainer.optimizer_class()  # what stepped: e.g. DeepSpeedCPUAdam when offloaded
        out.train_time_s = sum(telemetry.timer.durations)
        if trainer.ema is not None:
            out.ema = {"host_mib": trainer.ema.host_bytes() / 2**20, "updates": trainer.ema.updates}
    out.update(telemetry.summary())
    out.validation = validation_record(trainer.validator, trainer.validation_error, run.plan, telemetry.phases.records)
    if trainer.data_report:
        out.data = trainer.data_report
    out.partition = trainer.partition
    memory = out.memory if out.memory is not None else {}
    record = {**node_identity(), **memory, "partition": trainer.partition, "losses": trainer.logged_losses}
    record = write_rank_record(run_dir.path, distributed.rank(), record)  # every rank, its own file
    # Every rank's record reaches rank 0 over torch.distributed (the nodes may share no file system).
    records = distributed.gather_object(record)
    if records is not None:
        memory.update(per_rank_summary(records))
    if cfg.evaluate.enabled and cfg.model.conditioning == "class" and cfg.data.name == "digits" and not stop.received:
        # Imported when evaluating only: it brings scikit-learn's classifier.
        from zerotune.training.evaluate import evaluate_digits

        telemetry.phases.begin("sampling")  # the run's sampling phase (telemetry/phases.py): summary's memory.phases
        quality = evaluate_digits(trainer, cfg, run_dir)
        telemetry.phases.end()
        if quality is not None:
            out.quality = quality
    trainer.accelerator.end_training()
    summary.update(out.as_dict())


def _device_sync(trainer):
    device = trainer.accelerator.device
    if device.type == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None  # CPU work is synchronous

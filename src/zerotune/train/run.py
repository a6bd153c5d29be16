"""One training process, start to finish (checked, train, evaluate, summary; every rank runs this), with its
measurements: memory sampled in the background, steps timed after device sync."""

from __future__ import annotations

import logging
import time
import traceback
from contextlib import ExitStack
from typing import Any

from zerotune.config.compose.settle import Settled
from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config
from zerotune.host.memory import MemorySampler
from zerotune.host.platform import environment_info, node_identity
from zerotune.host.timing import StepTimer, gate_wait_s, process_start_time, startup_view
from zerotune.host.torch_memory import PhaseTimeline, pinned_memory_mib, torch_cuda_memory_stats
from zerotune.plan.resolve import ResolvedRun, check
from zerotune.rundir import JobSpec, RunDir, resume
from zerotune.rundir.loggers import NullLogger, RunLogger, make_logger
from zerotune.rundir.summary import (
    JsonDict,
    RunSummary,
    Status,
    experiment_info,
    is_oom,
    key_choices,
    per_rank_summary,
    write_rank_record,
)
from zerotune.train import distributed
from zerotune.train.distributed import StopSignals, apply_threads
from zerotune.train.rungs import PRUNED
from zerotune.train.trainer import Trainer
from zerotune.train.validation import validation_record

# Steps left out of the step-time statistics: kernel builds, allocator growth and caches settle in them.
WARMUP_STEPS = 5


class RunTelemetry:
    def __init__(self, nvme_dir: str | None, synchronize=None, started: float | None = None):
        """`started`: when this process's start-up began (epoch s; default: the process's creation)."""
        self.sampler = MemorySampler(nvme_dir=nvme_dir)
        self.timer = StepTimer(synchronize=synchronize, process_start=started)
        # The run's phases (loading, caching, step, sampling): each resets torch's peak statistics as it begins.
        self.phases = PhaseTimeline(self.sampler)

    def __enter__(self) -> RunTelemetry:
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sampler.stop()

    def step_memory(self) -> dict:
        """Current figures for one metrics row (a synchronous sample: the step boundary is a peak candidate)."""
        now = self.sampler.sample_now()
        cuda = torch_cuda_memory_stats()
        return {"memory/host_rss_mib": now.get("host_peak_rss_mib"), "memory/gpu_process_mib":
                now.get("gpu_peak_process_mib"), "memory/gpu_device_mib": now.get("gpu_peak_device_mib"),
                "memory/nvme_mib": now.get("nvme_peak_mib"),
                "memory/gpu_max_allocated_mib": cuda["gpu_peak_allocated_mib"],
                "memory/gpu_max_reserved_mib": cuda["gpu_peak_reserved_mib"]}

    def summary(self) -> dict[str, Any]:
        peaks, cuda = self.sampler.peaks(), torch_cuda_memory_stats()
        # torch's peaks restart with each phase: the run's are the largest of the phases' and the current ones.
        by_phase = self.phases.gpu_peaks()
        for key, phase_key in (("gpu_peak_reserved_mib", "gpu_max_reserved_mib"),
                               ("gpu_peak_allocated_mib", "gpu_max_allocated_mib")):
            cuda[key] = max((v for v in (cuda[key], by_phase[phase_key]) if v is not None), default=None)
        return {
            "memory": {
                "gpu_peak_process_mib": peaks["gpu_peak_process_mib"],
                "gpu_peak_device_mib": peaks["gpu_peak_device_mib"],
                "gpu_peak_allocated_mib": cuda["gpu_peak_allocated_mib"],
                "gpu_peak_reserved_mib": cuda["gpu_peak_reserved_mib"],
                "gpu_alloc_retries": cuda["alloc_retries"],
                "gpu_ooms": cuda["ooms"],
                "host_peak_rss_mib": peaks["host_peak_rss_mib"],
                "host_pinned_peak_mib": pinned_memory_mib(),
                "nvme_peak_mib": peaks["nvme_peak_mib"],
                "sampler_interval_s": self.sampler.interval_s,
                "phases": self.phases.records,  # the same list: a phase ended later (sampling) is in it too
            },
            "perf": self.timer.summary(WARMUP_STEPS),
        }


log = logging.getLogger("zerotune")


def train(resolved: ResolvedRun, spec: JobSpec, startup: dict | None = None) -> RunSummary:
    """Train the `resolved` run in `spec.run_dir`; returns the summary rank 0 writes there (INTERRUPTED when a stop
    signal ended training after the current step)."""
    start = time.time()
    # host/timing.py; `startup`: when this worker reached the job's gate and when it opened (job/gate.py)
    marks = {"process_start": process_start_time(), **(startup or {}), "train_start": start}
    distributed.ensure_single_process_env()
    cfg, rank = resolved.config, distributed.rank()
    run_dir = RunDir(spec.run_dir, is_writer=rank == 0)
    summary = _starting_summary(resolved.config, run_dir, resolved)
    logger: RunLogger = NullLogger()
    with StopSignals() as stop, ExitStack() as held:
        try:
            summary.threads = apply_threads(cfg.launch)
            if not spec.from_parent and rank == 0:  # under torchrun & co. no zerotune parent holds it
                held.enter_context(resume.job_lock(cfg.checkpoint, run_dir.path))
            # W&B's run config is the effective one, the user's DeepSpeed/accelerate files included.
            logger = make_logger(cfg, spec.run_dir, spec.run_name, spec.group, is_main=rank == 0)
            distributed.init_accelerate_state(resolved.use_deepspeed, cfg.launch.collective_timeout_s)
            _train_and_evaluate(resolved, run_dir, logger, stop, summary, marks)
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
            # A tune trial's plot would be 0.16 s of its few seconds; its figures are in metrics.jsonl.
            _close(summary, run_dir, logger, marks, plot=cfg.trial.storage is None)


def train_launched_externally(settled: Settled, spec: JobSpec) -> RunSummary:
    """Under torchrun / `accelerate launch` / `deepspeed` / `srun` with no zerotune parent, every rank runs
    this: rank 0 resolves the run (and writes config.yaml, ds_config.json, resolved.json), the other ranks
    receive it, and all train it. A refusal is recorded in summary.json (with config.yaml as settled) and
    raised on every rank."""
    try:
        resolved = _resolved_by_rank0(settled, spec)
    except ConfigError as exc:
        if distributed.rank() == 0:
            run_dir = RunDir(spec.run_dir)
            run_dir.write_config(settled.config)
            summary = _starting_summary(settled.config, run_dir)
            summary.error = {"type": "ConfigError", "key": exc.key, "message": str(exc)}
            summary.env = environment_info()
            run_dir.write_summary(summary)
        raise
    return train(resolved, spec)


def _resolved_by_rank0(settled: Settled, spec: JobSpec) -> ResolvedRun:
    resolved: ResolvedRun | None = None
    error: ConfigError | None = None
    if distributed.rank() == 0:
        try:
            resolved = check(settled, run_dir=spec.run_dir)
        except ConfigError as exc:
            error = exc
        else:
            run_dir = RunDir(spec.run_dir)
            run_dir.write_config(resolved.config)
            run_dir.write_ds_config(resolved.ds_config)
            resolved.save(spec.run_dir)
    if distributed.world_size() > 1:
        resolved, error = distributed.broadcast_object((resolved, error))
    if error is not None:
        raise error
    assert resolved is not None
    return resolved


def _starting_summary(cfg: Config, run_dir: RunDir, resolved: ResolvedRun | None = None) -> RunSummary:
    """What the summary says before training (failed until it is known otherwise); once `resolved`, with what the
    resolution settled: the config's sources and the model's sizes."""
    known: JsonDict = {"status": Status.FAILED, "choices": key_choices(cfg, distributed.world_size()),
                       "run_dir": str(run_dir.path), "experiment": experiment_info(cfg),
                       "previous_attempts": run_dir.previous_attempts()}
    if resolved is not None:
        stats = resolved.model_stats
        known |= {"config_sources": resolved.config_sources, "config_warnings": list(resolved.config_warnings),
                  "use_deepspeed": resolved.use_deepspeed, "num_params": stats.num_params,
                  "trainable_params": stats.num_trainable, "frozen_params": stats.num_frozen}
    return RunSummary.from_json(known)


def _close(summary: RunSummary, run_dir: RunDir, logger: RunLogger, marks: dict, plot: bool) -> None:
    summary.startup_marks, summary.startup = marks, startup_view(None, marks)  # the parent adds its own
    summary.env = environment_info()
    run_dir.write_summary(summary)
    run_dir.close()
    if plot and run_dir.is_writer and run_dir.file("metrics.jsonl").is_file():
        # Imported here: matplotlib is half a second that no worker's start should wait on.
        from zerotune.host.torch_memory import plot_run

        plot_run(run_dir.file("metrics.jsonl"), run_dir.file("telemetry.png"))
    images = [p for p in (run_dir.file("samples/grid.png"), run_dir.file("telemetry.png")) if p.is_file()]
    if images:
        logger.log_images("samples", [str(p) for p in images], step=int(summary.steps or 0))
    logger.log_summary({k: v for k, v in summary.to_json().items() if k != "env"})  # as summary.json says it
    logger.finish(0 if summary.status == Status.OK else 1)


def _train_and_evaluate(resolved: ResolvedRun, run_dir: RunDir, logger: RunLogger, stop: StopSignals,
                        summary: RunSummary, marks: dict) -> None:
    """Train, then gather every rank's figures and evaluate, into `summary` (in place: what training got
    through is there even when it fails)."""
    cfg = resolved.config
    out = RunSummary()  # what this function adds to `summary`, merged once all of it is known
    # perf.startup_s leaves out the wait at the job's gate: a cold op build there is reported apart (startup.*),
    # so the first job of a sweep does not look slower than the next.
    with RunTelemetry(nvme_dir=resolved.nvme_dir, started=marks["process_start"] + gate_wait_s(marks)) as telemetry:
        telemetry.phases.begin("loading")
        trainer = Trainer(resolved, run_dir, logger, phases=telemetry.phases)
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
    out.validation = validation_record(trainer.validator, trainer.validation_error, resolved.plan,
                                       telemetry.phases.records)
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
        from zerotune.train.evaluate import evaluate_digits

        telemetry.phases.begin("sampling")  # the run's sampling phase (host/torch_memory.py): summary's memory.phases
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

"""What a job's summary.json says from the parent's side: before the workers (or without them), and the
launcher's outcome and the whole tree's memory folded into the workers' own summary."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zerotune import checkpoints
from zerotune.errors import ConfigError
from zerotune.launch.elastic import LaunchResult
from zerotune.rundir import RunDir
from zerotune.rundir.plan import Plan
from zerotune.rundir.run_summary import JsonDict, RunSummary
from zerotune.rundir.spec import JobSpec
from zerotune.rundir.status import LAUNCHER_OVERRIDES, Status
from zerotune.rundir.summary import experiment_info, key_choices, per_rank_summary, read_rank_records
from zerotune.schema import Config, launch_world_size
from zerotune.slurm.job import slurm_record
from zerotune.telemetry import environment_info
from zerotune.telemetry.host import HostExit, near_limit


def base_summary(cfg: Config, spec: JobSpec) -> RunSummary:
    """What the job's summary says before (or without) the workers' own."""
    return RunSummary.from_json({"status": Status.FAILED, "choices": key_choices(cfg, launch_world_size(cfg.launch)),
                                 "run_dir": spec.run_dir, "experiment": experiment_info(cfg),
                                 "previous_attempts": RunDir(spec.run_dir).previous_attempts(),
                                 "checkpoint_dir": str(checkpoints.checkpoint_root(cfg.checkpoint.dir, Path(spec.run_dir))),
                                 "slurm": slurm_record(os.environ)})


@contextmanager
def refusal_recorded(cfg: Config, spec: JobSpec, run_dir: RunDir, plan: Plan | None = None) -> Iterator[None]:
    """A job refused before training (a ConfigError raised inside) still has its summary.json, naming the key
    (and the prediction, when the guard refused it); the error goes on."""
    try:
        yield
    except ConfigError as exc:
        summary = base_summary(cfg, spec)
        summary.error = {"type": type(exc).__name__, "key": exc.key, "message": str(exc)}
        summary.env = environment_info()
        if plan is not None:
            summary.plan = plan
        run_dir.write_summary(summary)
        raise


def merge_job_view(summary: RunSummary, result: LaunchResult, peaks: JsonDict, run_dir: Path) -> RunSummary:
    """Fold the launcher's outcome and the whole-tree memory peaks into the workers' summary."""
    if result.status == Status.INTERRUPTED:
        # The workers stopped on the signal the launcher passed on (their summary says so), or were killed
        # before they could write it.
        summary.status = Status.INTERRUPTED
        if summary.interrupted is None:
            summary.interrupted = {"signal": result.signal, "after_step": summary.steps}
        summary.interrupted["job_signal"] = result.signal  # the job process's own (slurm/job.py requeues on it)
    elif result.status != Status.OK and (summary.status is None or summary.status in LAUNCHER_OVERRIDES):
        # A worker's own OOM stays; a timeout, a death the worker could not record, or the kernel's OOM killer
        # is the launcher's to record.
        tail = log_tail(run_dir, local_rank=result.failed_local_rank)
        seen = {"type": result.status, "message": result.error, "failed_rank": result.failed_rank,
                "exitcode": result.exitcode, "failed_at": result.failed_at}
        host_oom = host_oom_error(result, summary, peaks)
        if host_oom is not None:
            # The kernel's OOM killer: whatever rank 0 recorded (a peer gone, or nothing) follows from it.
            if summary.error is not None:
                host_oom["rank0_error"] = summary.error
            summary.status, summary.error = Status.OOM, {**host_oom, "log_tail": tail}
        elif result.status == Status.TIMEOUT or summary.error is None:
            summary.status, summary.error = result.status, {**seen, "log_tail": tail}
        elif result.failed_rank not in (None, 0):
            # Rank 0 recorded what it saw (often a peer's closed connection); the cause is the rank that
            # failed first: its error leads, rank 0's stays beside it.
            summary.status = Status.FAILED
            summary.error = {**seen, "type": Status.FAILED, "rank0_error": summary.error, "log_tail": tail}
    # A job whose workers died without a summary still says which checkpoint it can resume from.
    found = checkpoints.latest(Path(summary.checkpoint_dir)) if summary.checkpoint_dir else None
    if summary.checkpoint is None:
        summary.checkpoint = {}
    summary.checkpoint.setdefault("last_complete", str(found) if found else None)
    if summary.memory is None:
        summary.memory = {}
    memory = summary.memory
    memory["host_peak_rss_mib"] = peaks["host_peak_rss_mib"]  # all ranks, not just rank 0
    if peaks["nvme_peak_mib"] is not None:
        memory["nvme_peak_mib"] = max(peaks["nvme_peak_mib"], memory.get("nvme_peak_mib") or 0.0)
    for key in ("gpu_peak_process_mib", "gpu_peak_device_mib"):
        if memory.get(key) is None and peaks[key] is not None:
            memory[key] = peaks[key]  # the worker died before writing its own figures
    files = per_rank_summary(read_rank_records(run_dir))
    # Rank 0 gathered every rank's record over torch.distributed (all nodes); this node's files are a
    # subset, and the only record when the job failed before the gather.
    if len(files.get("per_rank", [])) >= len(memory.get("per_rank") or []):
        memory.update(files)
    return summary


def host_oom_error(result: LaunchResult, summary: RunSummary, peaks: JsonDict) -> JsonDict | None:
    """A worker killed by SIGKILL while the host was out of memory (its headroom, or the workers' RSS against
    the host's limit or plan.host_mib, within a small margin at the last samples; or the kernel's own record of
    an OOM kill) is the kernel's OOM killer's doing: the error for the summary, with the predicted and measured
    figures. None for any other death: a SIGKILL with memory to spare is a person's or a scheduler's."""
    if result.exitcode != -signal.SIGKILL or result.host is None:
        return None
    fit = (summary.plan.host_fit if summary.plan else None) or {}
    near = near_limit(result.host.samples, fit.get("budget_mib"))
    if near is None and not result.host.kernel_says_oom:
        return None
    last = result.host.samples[-1].memory.as_dict() if result.host.samples else {}
    figures = near or {**last, "tree_rss_mib": None, "near": None}
    predicted, peak = fit.get("needed_mib"), peaks.get("host_peak_rss_mib")
    # The figures first: a report shows the message's first 120 characters.
    message = (f"{'no prediction' if predicted is None else f'predicted {predicted:,.0f} MiB'}, peak RSS {_mib(peak)}, "
               f"{_mib(figures.get('available_mib'))} available of {_mib(figures.get('limit_mib'))}: rank "
               f"{result.failed_rank} was killed (SIGKILL) by the kernel's OOM killer "
               f"({'; '.join(_evidence(result.host, near))}). Less host memory: zero_stage=3 offload=nvme "
               "offload.path=<folder>, a smaller model, resolution or batch, or fewer launch.num_processes")
    return {"type": "HostOutOfMemory", "kind": "host", "message": message, "failed_rank": result.failed_rank,
            "exitcode": result.exitcode, "predicted_mib": predicted, "peak_rss_mib": peak,
            "rss_at_last_samples_mib": figures.get("tree_rss_mib"), "available_mib": figures.get("available_mib"),
            "total_mib": figures.get("total_mib"), "limit_mib": figures.get("limit_mib"),
            "cgroup_limit_mib": figures.get("cgroup_limit_mib"), "budget_mib": fit.get("budget_mib"),
            "kernel_log": result.host.kernel_log, "cgroup_oom_kills": result.host.cgroup_oom_kills}


def _evidence(host: HostExit, near: JsonDict | None) -> list[str]:
    said = ["the kernel's log names the worker as OOM-killed"] if host.kernel_log else []
    if host.cgroup_oom_kills:
        said.append(f"the cgroup counted {host.cgroup_oom_kills} OOM kill(s) during the job")
    if near is not None:
        gap = near["gap_mib"]
        said.append(f"{near['near']}: {gap:,.0f} MiB left" if gap > 0 else f"{near['near']}: {-gap:,.0f} MiB over")
    return said


def _mib(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:,.0f} MiB"


def log_tail(run_dir: Path, lines: int = 30, local_rank: int | None = None) -> list[str]:
    """The last lines a worker wrote to stderr (the launcher keeps one log per rank): the failed rank's
    when known, else the latest written."""
    pattern = f"**/{local_rank}/stderr.log" if local_rank is not None else "**/stderr.log"
    logs = sorted((run_dir / "logs").glob(pattern), key=lambda p: p.stat().st_mtime)
    if not logs:
        return []
    return logs[-1].read_text(errors="replace").splitlines()[-lines:]

"""What a job's summary.json says from the parent's side (before or without the workers, the launcher's outcome,
the whole tree's memory), and which node and rank of a failed multi-node job failed first: node 0 sees only its own
rank's error, so every other node records summary.node<k>.json for it to read."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config, launch_world_size
from zerotune.host.platform import environment_info
from zerotune.host.ram import HostExit, near_limit
from zerotune.job.elastic import LaunchResult
from zerotune.job.slurm import slurm_record
from zerotune.rundir import JobSpec, RunDir, checkpoints
from zerotune.rundir.plan import Plan
from zerotune.rundir.summary import (
    LAUNCHER_OVERRIDES,
    JsonDict,
    RunSummary,
    Status,
    experiment_info,
    key_choices,
    node_summary_name,
    per_rank_summary,
    read_rank_records,
)


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
        summary.interrupted["job_signal"] = result.signal  # the job process's own (job/slurm.py requeues on it)
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
            # Rank 0 saw a peer's closed connection, say: the rank that failed first leads, rank 0's error beside it.
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
    """The summary's error for a worker SIGKILLed by the kernel's OOM killer (the last samples within a margin of a
    limit or plan.host_mib, or the kernel's record of an OOM kill), with predicted and measured figures; None for
    any other death (a SIGKILL with memory to spare is a person's or a scheduler's)."""
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


# How long node 0 waits for the other nodes' records: they fail within moments of each other (a peer's death
# ends the others' collectives at once), or not at all (a node lost whole writes nothing).
PEER_RECORD_WAIT_S = 15.0


def _first(failures: list[JsonDict]) -> JsonDict:
    """The cause among the nodes' failures: a rank killed by a signal (a peer's death ends the others' ranks with
    an error, never a signal), else the one seen first."""
    killed = [f for f in failures if (f.get("exitcode") or 0) < 0]
    return min(killed or failures, key=lambda f: f.get("failed_at") or float("inf"))


def describe(failure: JsonDict) -> str:
    code = failure.get("exitcode")
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"failed: {failure.get('message')}"
    return f"rank {failure.get('failed_rank')} on {failure.get('node')} (node {failure.get('node_rank')}) {how}"


def name_failed_node(summary: RunSummary, result: LaunchResult, node: str, run_dir: Path, nnodes: int) -> None:
    """Node 0's summary of a failed job of several nodes: the error names the node and rank that failed first,
    with every node's failure beside it (`nodes`), and the nodes that recorded nothing (`silent_nodes`)."""
    own = {**(summary.error or {}), "node_rank": 0, "node": node, "failed_at": result.failed_at,
           "exitcode": result.exitcode, "failed_rank": result.failed_rank}
    deadline = time.monotonic() + PEER_RECORD_WAIT_S  # the other nodes' records; none yet: not written
    while True:
        records = {k: RunSummary.read_if_whole(run_dir, node_summary_name(k)) for k in range(1, nnodes)}
        if all(r is not None for r in records.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    peers = [{"node_rank": k, "node": r.node, **r.error} for k, r in records.items()
             if r is not None and r.status != Status.OK and isinstance(r.error, dict)]
    silent = [k for k, r in records.items() if r is None]  # nothing recorded within PEER_RECORD_WAIT_S
    first = _first([own, *peers])
    error = {"type": Status.FAILED, "message": describe(first), "failed_rank": first.get("failed_rank"),
             "failed_node": first.get("node"), "failed_node_rank": first["node_rank"],
             "nodes": [{k: f.get(k) for k in ("node_rank", "node", "failed_rank", "exitcode", "message")}
                       for f in (own, *peers)],
             "log_tail": first.get("log_tail")}
    if first is not own:
        error["rank0_error"] = summary.error
    if silent:
        error["silent_nodes"] = silent
        error["message"] += f"; node(s) {', '.join(map(str, silent))} recorded nothing (lost, or killed whole)"
    summary.error = error

"""SLURM: each SLURM task (one per node) is zerotune's job process for its node, its launch geometry (nodes, node
rank, first host, GPUs) read from SLURM's environment as submitit reads it; the job's records and requeue."""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from zerotune.config.schema import Config, as_dict
from zerotune.host import process
from zerotune.rundir.summary import ENDS_THE_STEP, RunSummary, Status

log = logging.getLogger(__name__)

# The port every node derives from the job id (no exchange needed); launch.master_port overrides it.
PORT_BASE, PORT_SPAN = 20000, 20000


def in_slurm_job(env: Mapping[str, str], mode: Any = "auto") -> bool:
    """Whether to take the launch geometry from SLURM: auto = inside a job submitit started, or a task of an
    `srun` step with one task per node (`srun python train.py` in an sbatch script); not a bare salloc shell."""
    if str(mode).lower() in ("false", "none", "null"):
        return False
    if "SLURM_JOB_ID" not in env or "SLURM_JOB_NODELIST" not in env:
        return False
    return str(mode).lower() == "true" or env.get("SUBMITIT_EXECUTOR") == "slurm" or one_task_per_node(env)


def one_task_per_node(env: Mapping[str, str]) -> bool:
    """An srun step whose tasks are one per node: each is zerotune's job process for its node."""
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES")
    return "SLURM_STEP_ID" in env and tasks is not None and tasks == nodes


def slurm_record(env: Mapping[str, str]) -> dict | None:
    """The SLURM job a run ran in, for its summary.json (None outside SLURM). restart_count: 0 for the first
    attempt, then one more per requeue."""
    if "SLURM_JOB_ID" not in env:
        return None
    array = env.get("SLURM_ARRAY_JOB_ID")
    return {"job_id": env["SLURM_JOB_ID"],
            "array_job": f"{array}_{env.get('SLURM_ARRAY_TASK_ID')}" if array else None,
            "restart_count": int(env.get("SLURM_RESTART_COUNT") or 0), "partition": env.get("SLURM_JOB_PARTITION"),
            "nodelist": env.get("SLURM_JOB_NODELIST"), "num_nodes": int(env.get("SLURM_JOB_NUM_NODES") or 1)}


def record_lost_attempts(run_dir: str | Path, env: Mapping[str, str]) -> list[str]:
    """In a requeued SLURM job, once earlier records are in attempts/: give each attempt that left no record (killed
    before writing one, its node lost) one with status LOST, so there is one folder per SLURM restart. Returns the
    folders added."""
    from zerotune.rundir import ATTEMPTS, RunDir

    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    run = RunDir(run_dir, is_writer=False)
    recorded = sum(_of_job(run.path / folder, env["SLURM_JOB_ID"]) for folder in run.previous_attempts()) \
        if restarts else 0
    added = []
    for restart in range(recorded, restarts):
        added.append(f"{ATTEMPTS}/{len(run.previous_attempts()) + 1}")
        (run.path / added[-1]).mkdir(parents=True)
        RunSummary(
            status=Status.LOST, run_dir=str(run.path), slurm={**(slurm_record(env) or {}), "restart_count": restart},
            error={"type": Status.LOST, "message": f"attempt {restart + 1} of SLURM job {env['SLURM_JOB_ID']} left no "
                   "record: it ended (killed, or its node lost) before it wrote one"}).write(run.path / added[-1])
    return added


def _of_job(folder: Path, job_id: str) -> bool:
    """Whether an attempt's records are this SLURM job's: its summary says so, or its config's launch run id (an
    attempt killed before its summary)."""
    import yaml

    summary = RunSummary.read_if_whole(folder)
    if summary is not None and summary.as_dict():
        return (summary.slurm or {}).get("job_id") == job_id
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    return (config.get("launch") or {}).get("run_id") == f"slurm-{job_id}"


def job_start_time(env: Mapping[str, str]) -> datetime | None:
    """When SLURM started this job (scontrol's StartTime), in an srun step of several nodes; else None. Each
    node's task composes its own config: this one clock gives `${now:...}` in hydra.run.dir one folder."""
    if not one_task_per_node(env) or int(env.get("SLURM_STEP_NUM_NODES") or 1) < 2:
        return None
    from zerotune.job.slurm_cluster import show_job

    started = (show_job(env["SLURM_JOB_ID"]) or {}).get("StartTime", "")
    try:
        return datetime.fromisoformat(started)
    except ValueError:  # "Unknown", or no record
        return None


def _gpus_on_node(env: Mapping[str, str]) -> int | None:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key)
        if value:
            m = re.search(r"(\d+)$", value.split(",")[0])  # "8", or "a100:8" / "gpu:a100:8"
            if m and int(m.group(1)) > 0:
                return int(m.group(1))
    return None


def launch_from_slurm(launch: Mapping[str, Any]) -> dict:
    """The launch block for this node: SLURM's nodes, node index and first host (read by submitit, which
    started the job); the node's GPUs as workers."""
    from submitit.slurm.slurm import SlurmJobEnvironment

    job = SlurmJobEnvironment()
    out = {**launch, "nnodes": job.num_nodes, "node_rank": job.node, "master_addr": job.hostnames[0]}
    if str(launch.get("master_port", "auto")) == "auto":
        # SLURM_JOB_ID: unique per array task too (submitit's job_id is "<array>_<task>" there).
        out["master_port"] = PORT_BASE + int(os.environ["SLURM_JOB_ID"]) % PORT_SPAN
    gpus = _gpus_on_node(os.environ)
    if gpus:
        out["num_processes"] = gpus
    out["run_id"] = f"slurm-{os.environ['SLURM_JOB_ID']}"
    return out


def job_settings(config: Config, run_dir: str) -> dict[str, Any]:
    """Inside a SLURM job started by hydra/launcher=slurm: nodes, node rank, master and GPUs from SLURM; a
    requeued attempt continues the job's newest checkpoint. As `key: value` settings for `settle`."""
    if not in_slurm_job(os.environ, config.launch.slurm):
        return {}
    mapped = launch_from_slurm(as_dict(config.launch))
    log.info("SLURM job %s: node %s of %s, master %s:%s, %s workers on this node", os.environ["SLURM_JOB_ID"],
             mapped["node_rank"], mapped["nnodes"], mapped["master_addr"], mapped["master_port"],
             mapped["num_processes"])
    settings: dict[str, Any] = {f"launch.{key}": value for key, value in mapped.items()}
    if continue_requeued(config, run_dir):
        settings["resume.path"] = "auto"
    return settings


def continue_requeued(cfg: Config, run_dir: str | Path) -> bool:
    """Whether this attempt resumes with resume=auto: a requeued one (SLURM_RESTART_COUNT > 0) continues the newest
    complete checkpoint its job saved, or starts as the first attempt did when there is none."""
    from zerotune.rundir import checkpoints

    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0 or str(cfg.resume.path) in ("auto", "latest"):
        return False
    if not checkpoints.list_complete(checkpoints.checkpoint_root(cfg.checkpoint.dir, Path(run_dir))):
        return False
    log.info("requeued SLURM job (restart %s): resume=auto instead of resume=%s", os.environ["SLURM_RESTART_COUNT"],
             cfg.resume.path)
    return True


def ends_the_step(summary: RunSummary, node_rank: int) -> bool:
    """Whether this task exits non-zero once its job is recorded, even in a sweep: node 0's, in a failed multi-node
    SLURM job, so that srun (--kill-on-bad-exit=1) ends the other nodes' tasks, perhaps stuck on a lost peer."""
    nodes = int((summary.slurm or {}).get("num_nodes") or 1)
    return node_rank == 0 and nodes > 1 and summary.status in ENDS_THE_STEP


def requeue_if_preempted(summary: RunSummary) -> None:
    """Under submitit, after the workers stopped on its pre-emption signal (SIGUSR2) and saved: call submitit's
    handler (set aside by job/slurm_task.py), which requeues the job and exits. Not when the signal comes:
    `scontrol requeue` has SLURM SIGTERM, then SIGKILL, every process of the job, workers mid-save included.
    Only node 0's task requeues (submitit's handler does nothing on the others)."""
    name = (summary.interrupted or {}).get("job_signal")
    sig = getattr(signal, str(name), None)
    if sig is None:
        return
    handler = process.set_aside(sig) or signal.getsignal(sig)
    # submitit's SignalHandler method
    if not callable(handler) or getattr(handler, "__name__", None) != "checkpoint_and_try_requeue":
        return
    try:
        handler(sig, None)  # requeues, then sys.exit(-1); returns on a node other than 0
    except Exception as exc:  # e.g. timed out too many times: the job ends interrupted
        log.error("the job was not requeued: %s", exc)

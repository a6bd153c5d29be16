"""With hydra/launcher=slurm, the sweep's SLURM request is checked against the cluster before anything is
submitted: the partition, nodes, GPUs, CPUs and memory per node, and the time limit (slurm/request.py,
against what slurm/cluster.py reads from scontrol).
Each refusal is a config error naming the `hydra.launcher.*` key, with a value that passes as the fix.

The Hydra callback that runs it before the first job is submitted is cli/slurm_check.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from typing import Any

from zerotune.compose.settle import Settled
from zerotune.errors import ConfigError
from zerotune.plan import gpus
from zerotune.schema import Config
from zerotune.slurm.cluster import Cluster, read_cluster
from zerotune.slurm.request import (
    JobTime,
    Partition,
    Request,
    check_request,
    check_time_to_checkpoint,
    fitting_nodes,
)

log = logging.getLogger("zerotune")


def is_slurm(launcher: Mapping[str, Any]) -> bool:
    return str(launcher.get("_target_", "")).endswith("SlurmLauncher")


def request_of(launcher: Mapping[str, Any]) -> Request:
    """The launcher's settings (Hydra's `hydra.launcher` node) sbatch matches against the cluster; a count below 1
    is refused here."""
    # A null setting is Request's default (None: not asked).
    given: dict[str, Any] = {f.name: launcher.get(f.name) for f in fields(Request) if launcher.get(f.name) is not None}
    req = Request(**given)
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "tasks_per_node", "mem_gb", "timeout_min"):
        value = getattr(req, key)
        if value is not None and value < (0 if key == "gpus_per_node" else 1):
            raise ConfigError(f"hydra.launcher.{key}", f"must be at least 1, got {value}",
                              f"hydra.launcher.{key}={1 if key in ('nodes', 'tasks_per_node', 'timeout_min') else 'null'}")
    return req


def check_sweep(req: Request, jobs: list[list[str]], settle_job: Callable[[list[str]], Settled],
                env: Mapping[str, str] | None = None) -> Partition:
    """Check the sweep's request against the cluster; the partition the jobs go to, or a ConfigError. `jobs`:
    each job's overrides; `settle_job`: a job's config from its overrides, as its launcher composes it."""
    cluster = read_cluster(env)
    partition = check_request(cluster, req)
    check_time_to_checkpoint(partition, req, job_times(jobs, settle_job, cluster, partition, req))
    return partition


def job_times(jobs: list[list[str]], settle_job: Callable[[list[str]], Settled], cluster: Cluster,
              partition: Partition, req: Request) -> list[JobTime]:
    """What each job needs before its first checkpoint. A time per step is known only for jobs with GPUs of a
    known card, so only then are the jobs composed (and planned)."""
    if not req.gpus_per_node:
        return [JobTime("", None, False, None)]
    card = gres_card(fitting_nodes(cluster, partition.name, req))
    times = []
    for overrides in jobs:
        label = " ".join(overrides)
        try:
            settled = settle_job(overrides)
        except ConfigError:  # the job refuses itself, naming the key, when it runs
            times.append(JobTime(label, None, False, None))
            continue
        cfg = settled.config
        steps, on_signal = steps_to_first_checkpoint(cfg), cfg.checkpoint.on_signal
        job_card = card or (gpus.CATALOG.get(cfg.plan.gpu.lower()) if cfg.plan.gpu else None)
        floor = None
        if steps and not on_signal and job_card is not None:
            floor = step_floor(settled, job_card, req)
        times.append(JobTime(label, steps, on_signal, floor))
    return times


def steps_to_first_checkpoint(cfg: Config) -> int | None:
    """Optimizer steps to the job's first scheduled save; None where none is scheduled, or where they are not
    known (a resumed job starts part way; a plan.only job does not train)."""
    if cfg.resume.path is not None or cfg.plan.only:
        return None
    every, last = cfg.checkpoint.every_n_steps or 0, cfg.train.max_steps
    if every > 0 and (last is None or every <= last):
        return every
    return last if cfg.checkpoint.final and last else None


# gres types as clusters name them (a100, nvidia_h100_80gb_hbm3, rtx_4090) -> the catalog's card. A token must
# match whole (an "l40" is not an "l4"); an unknown type gives no time floor rather than a wrong one.
_GRES_CARDS = {"h200": "h200", "h100": "h100", "a100": "a100-80", "l40s": "l40s", "l4": "l4", "4090": "rtx4090",
               "rtx4090": "rtx4090", "3090": "rtx3090", "rtx3090": "rtx3090"}


def gres_card(nodes: list) -> gpus.GPU | None:
    """The fastest card the job could get, among the nodes it fits on; None if any of them names no known type
    (the time per step is then a bound only for the card plan.gpu names)."""
    cards = []
    for node in nodes:
        found = [_GRES_CARDS[t] for gres_type in node.gpu_types for t in re.split(r"[^a-z0-9]+", gres_type.lower())
                 if t in _GRES_CARDS]
        if not node.gpu_types or len(found) != len(node.gpu_types):
            return None
        cards += [gpus.CATALOG[c] for c in found]
    return max(cards, key=lambda g: (g.bf16_tflops, g.host_link_gbps), default=None)


def step_floor(settled: Settled, card: gpus.GPU, req: Request) -> float | None:
    """The planner's lower bound on one optimizer step of this job on `card`, from the terms that do not depend
    on this machine (the card's compute and host link; not the CPU optimizer, timed here). None where the
    planner cannot tell (it fails on this job: the job reports why itself)."""
    from zerotune.plan.predict import predict
    from zerotune.platform import ANY_CUDA_GPU
    from zerotune.preflight import check

    per_node = req.gpus_per_node or 0
    launch = replace(settled.config.launch, num_processes=per_node, nnodes=req.nodes)
    on_cluster = replace(settled, config=replace(settled.config, launch=launch), world_size=per_node * launch.nnodes)
    try:
        checked = check(on_cluster, ANY_CUDA_GPU)
        terms = predict(checked, card).time_terms
    except Exception as exc:  # noqa: BLE001 (no floor is no refusal)
        log.debug("no time floor for %s: %s", settled.config.launch, exc)
        return None
    known = [t.seconds for t in terms if t.term in ("compute", "pcie") and t.seconds]
    return max(known, default=None)

"""With hydra/launcher=slurm, the sweep's SLURM request is checked against the cluster before anything is
submitted: the partition, nodes, GPUs, CPUs and memory per node, and the time limit (slurm/request.py,
against what slurm/cluster.py reads from scontrol).
Each refusal is a config error naming the `hydra.launcher.*` key, with a value that passes as the fix.

The Hydra callback that runs it before the first job is submitted is cli/slurm_check.py.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import fields

from omegaconf import DictConfig, open_dict

from zerotune.errors import ConfigError
from zerotune.plan import gpus
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


def is_slurm(launcher: DictConfig) -> bool:
    return str(launcher.get("_target_", "")).endswith("SlurmLauncher")


def request_of(launcher: DictConfig) -> Request:
    """The launcher's settings sbatch matches against the cluster; a count below 1 is refused here."""
    # A null setting is Request's default (None: not asked).
    req = Request(**{f.name: launcher.get(f.name) for f in fields(Request) if launcher.get(f.name) is not None})
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "tasks_per_node", "mem_gb", "timeout_min"):
        value = getattr(req, key)
        if value is not None and value < (0 if key == "gpus_per_node" else 1):
            raise ConfigError(f"hydra.launcher.{key}", f"must be at least 1, got {value}",
                              f"hydra.launcher.{key}={1 if key in ('nodes', 'tasks_per_node', 'timeout_min') else 'null'}")
    return req


def check_sweep(config: DictConfig, env: Mapping[str, str] | None = None,
                load_job: Callable[[list[str]], DictConfig] | None = None) -> Partition:
    """Check the request of `config` (the sweep's config, with its `hydra` node) against the cluster; the
    partition the jobs go to, or a ConfigError. `load_job`: a job's config from its overrides (Hydra's own,
    as its launcher composes them, by default)."""
    req = request_of(config.hydra.launcher)
    cluster = read_cluster(env)
    partition = check_request(cluster, req)
    check_time_to_checkpoint(partition, req, job_times(config, cluster, partition, req, load_job))
    return partition


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands the command line's."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _hydra_loader(config: DictConfig) -> Callable[[list[str]], DictConfig]:
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    return lambda overrides: loader.load_sweep_config(config, overrides)


def job_times(config: DictConfig, cluster: Cluster, partition: Partition, req: Request,
              load_job: Callable[[list[str]], DictConfig] | None = None) -> list[JobTime]:
    """What each job needs before its first checkpoint. A time per step is known only for jobs with GPUs of a
    known card, so only then are the jobs composed (and planned)."""
    if not req.gpus_per_node:
        return [JobTime("", None, False, None)]
    card = gres_card(fitting_nodes(cluster, partition.name, req))
    load = load_job or _hydra_loader(config)
    times = []
    for overrides in sweep_jobs(config):
        cfg = load(overrides)
        steps, on_signal = steps_to_first_checkpoint(cfg), bool(cfg.checkpoint.on_signal)
        job_card = card or (gpus.CATALOG.get(str(cfg.plan.gpu).lower()) if cfg.plan.gpu else None)
        floor = None
        if steps and not on_signal and job_card is not None:
            floor = step_floor(cfg, overrides, job_card, req)
        times.append(JobTime(" ".join(overrides), steps, on_signal, floor))
    return times


def steps_to_first_checkpoint(cfg: DictConfig) -> int | None:
    """Optimizer steps to the job's first scheduled save; None where none is scheduled, or where they are not
    known (a resumed job starts part way; a plan.only job does not train)."""
    if cfg.resume.path is not None or cfg.plan.only:
        return None
    every, last = int(cfg.checkpoint.every_n_steps or 0), cfg.train.max_steps
    if every > 0 and (last is None or every <= int(last)):
        return every
    return int(last) if cfg.checkpoint.final and last else None


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


def step_floor(cfg: DictConfig, overrides: list[str], card: gpus.GPU, req: Request) -> float | None:
    """The planner's lower bound on one optimizer step of this job on `card`, from the terms that do not depend
    on this machine (the card's compute and host link; not the CPU optimizer, timed here). None where the
    planner cannot tell (it fails on this job: the job reports why itself)."""
    from zerotune.plan.predict import predict
    from zerotune.platform import ANY_CUDA_GPU
    from zerotune.preflight import preflight

    job, per_node = copy.deepcopy(cfg), int(req.gpus_per_node or 0)
    with open_dict(job):
        job.pop("hydra", None)
        job.launch.num_processes, job.launch.nnodes = per_node, int(req.nodes)
    try:
        checked = preflight(job, world_size=per_node * req.nodes, platform=ANY_CUDA_GPU,
                            overrides=overrides)
        terms = predict(checked, card)["time_terms"]
    except Exception as exc:  # noqa: BLE001 (no floor is no refusal)
        log.debug("no time floor for %s: %s", overrides, exc)
        return None
    known = [t["seconds"] for t in terms if t["term"] in ("compute", "pcie") and t["seconds"]]
    return max(known, default=None)

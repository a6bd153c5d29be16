"""SLURM: each SLURM task (one per node) is zerotune's job process for its node.

hydra/launcher=slurm (conf/hydra/launcher/slurm.yaml) submits a job with `nodes` nodes and one task
per node. On each node, the job process reads SLURM's environment and starts that node's workers
through torch's elastic launcher, as if typed `launch.nnodes=SLURM_NNODES launch.node_rank=SLURM_NODEID
launch.master_addr=<first host> launch.master_port=<fixed> launch.num_processes=<GPUs on the node>`.
submitit (hydra-submitit-launcher's engine) reads SLURM's variables and expands its node list.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

# The port every node derives from the job id (no exchange needed); launch.master_port overrides it.
PORT_BASE, PORT_SPAN = 20000, 20000


def in_slurm_job(env: Mapping[str, str], mode: Any = "auto") -> bool:
    """Whether to take the launch geometry from SLURM: auto = inside a job submitit started."""
    if str(mode).lower() in ("false", "none", "null"):
        return False
    if "SLURM_JOB_ID" not in env or "SLURM_JOB_NODELIST" not in env:
        return False
    return str(mode).lower() == "true" or env.get("SUBMITIT_EXECUTOR") == "slurm"


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
    out = dict(launch)
    out["nnodes"] = job.num_nodes
    out["node_rank"] = job.node
    out["master_addr"] = job.hostnames[0]
    if str(launch.get("master_port", "auto")) == "auto":
        out["master_port"] = PORT_BASE + int(job.job_id) % PORT_SPAN
    gpus = _gpus_on_node(os.environ)
    if gpus:
        out["num_processes"] = gpus
    out["run_id"] = f"slurm-{job.job_id}"
    return out

"""SLURM: each SLURM task (one per node) is zerotune's job process for its node.

hydra/launcher=slurm (conf/hydra/launcher/slurm.yaml) submits a job with `nodes` nodes and one task
per node. On each node, the job process reads SLURM's environment and starts that node's workers
through torch's elastic launcher, as if typed `launch.nnodes=SLURM_NNODES launch.node_rank=SLURM_NODEID
launch.master_addr=<first host> launch.master_port=<fixed> launch.num_processes=<GPUs on the node>`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The port every node derives from the job id (no exchange needed); launch.master_port overrides it.
PORT_BASE, PORT_SPAN = 20000, 20000


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, as `scontrol show hostnames` does (without scontrol).

    "gpu[01-03,07],login1,rack[1-2]-n[1-2]" -> gpu01 gpu02 gpu03 gpu07 login1 rack1-n1 rack1-n2 rack2-n1 rack2-n2
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if item:
            hosts.extend(_expand(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append("".join(current))
    return parts


def _expand(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for value in _range_values(m.group(1), item):
        out.extend(head + value + rest for rest in _expand(tail))
    return out


def _range_values(spec: str, item: str) -> list[str]:
    values = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in SLURM node list item {item!r}")
        if not sep:
            values.append(lo)
            continue
        width = len(lo)  # zero padding, as SLURM writes it: 001-010
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in SLURM node list item {item!r}")
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return values


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


def launch_from_slurm(launch: Mapping[str, Any], env: Mapping[str, str]) -> dict:
    """The launch block for this node: SLURM's nodes, node index and first host; the node's GPUs as workers."""
    out = dict(launch)
    out["nnodes"] = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    out["node_rank"] = int(env.get("SLURM_NODEID", 0))
    out["master_addr"] = parse_nodelist(env["SLURM_JOB_NODELIST"])[0]
    if str(launch.get("master_port", "auto")) == "auto":
        out["master_port"] = PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN
    gpus = _gpus_on_node(env)
    if gpus:
        out["num_processes"] = gpus
    out["run_id"] = f"slurm-{env['SLURM_JOB_ID']}"
    return out

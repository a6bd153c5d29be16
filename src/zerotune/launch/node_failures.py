"""A job of several nodes that failed: which node and rank failed first, for node 0's summary.json.

Node 0 writes the job's summary, but what it sees of a peer's death is its own rank's error (gloo's "Connection
closed by peer", NCCL's watchdog timeout). Every other node records its own ranks' outcome in
summary.node<k>.json beside it (launch/job.py), over the shared run folder; node 0 reads them and names the cause.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from zerotune.launch.elastic import LaunchResult
from zerotune.rundir.run_summary import JsonDict, RunSummary, node_summary_name
from zerotune.rundir.status import Status

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

"""How a SLURM job's end is read and recorded, without a cluster: a job that ended without a result
(job/slurm_launcher.py), srun's word on the task that ended first, and the node that failed first in a job of several
(job/records.py). The real cluster runs them in tests/test_slurm.py (slow)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerotune.job import records as node_failures
from zerotune.job import slurm_launcher as slurm_end
from zerotune.job.elastic import LaunchResult
from zerotune.job.slurm import ends_the_step
from zerotune.report.collect import collect_runs
from zerotune.rundir.summary import RunSummary


class FakeJob:
    """What the waiting reads of a submitit job: its id and each task's result file."""

    def __init__(self, folder: Path, tasks: int = 1):
        self.job_id, self.num_tasks = "7_0", tasks
        self.files = [folder / f"7_0_{i}_result.pkl" for i in range(tasks)]

    def task(self, i: int):
        return SimpleNamespace(paths=SimpleNamespace(result_pickle=self.files[i]))


def states(*sequence: str | None):
    """A state function answering `sequence` in turn, then its last answer for ever."""
    answers = list(sequence)
    return lambda job_id: answers.pop(0) if len(answers) > 1 else answers[0]


def test_a_job_with_its_results_written_is_over(tmp_path):
    job = FakeJob(tmp_path, tasks=2)
    for f in job.files:
        f.write_bytes(b"x")
    assert slurm_end.wait_for_end(job, states("RUNNING"), poll_s=0.01) == "COMPLETED"


def test_a_job_that_left_the_queue_without_results_ends_with_slurms_state(tmp_path):
    job = FakeJob(tmp_path, tasks=2)
    job.files[0].write_bytes(b"x")  # task 1 never wrote: the job is not over by its files
    assert slurm_end.wait_for_end(job, states("RUNNING", "RUNNING", "CANCELLED"), poll_s=0.01,
                                  grace_s=0.05) == "CANCELLED"
    assert slurm_end.wait_for_end(job, states(None), poll_s=0.01, grace_s=0.05) is None  # SLURM forgot it


def test_a_requeued_job_is_waited_on_until_its_next_attempt_writes(tmp_path):
    job = FakeJob(tmp_path)
    seen = []

    def state(job_id):
        seen.append(job_id)
        if len(seen) == 5:
            job.files[0].write_bytes(b"x")
        return ["RUNNING", "REQUEUED", "PENDING", "RUNNING"][min(len(seen) - 1, 3)]

    assert slurm_end.wait_for_end(job, state, poll_s=0.01, grace_s=0.0) == "COMPLETED" and len(seen) == 5


def fake_slurm_commands(folder: Path, squeue: str, scontrol: str, monkeypatch) -> None:
    for name, out in (("squeue", squeue), ("scontrol", scontrol)):
        script = folder / name
        script.write_text(f"#!/bin/sh\nprintf '%s' '{out}'\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_the_state_comes_from_squeue_while_queued_then_from_scontrol(tmp_path, monkeypatch):
    fake_slurm_commands(tmp_path, "RUNNING\n", "", monkeypatch)
    assert slurm_end.job_state("7_0") == "RUNNING"
    fake_slurm_commands(tmp_path, "", "JobId=8 ArrayJobId=7 JobName=main JobState=CANCELLED Reason=None\n",
                        monkeypatch)
    assert slurm_end.job_state("7_0") == "CANCELLED"
    fake_slurm_commands(tmp_path, "", "", monkeypatch)
    assert slurm_end.job_state("7_0") is None


@pytest.mark.parametrize(("own", "state", "status"), [
    ("interrupted", "CANCELLED", "cancelled"),   # scancel's SIGTERM stopped the workers: SLURM says why
    (None, "CANCELLED", "cancelled"),            # cancelled before it started: no folder yet
    ("failed", "FAILED", "failed"),              # the job's own account of its failure stays
    (None, "NODE_FAIL", "failed"),
    (None, None, "failed"),
])
def test_a_job_without_a_result_is_recorded_and_reported(tmp_path, own, state, status):
    run_dir = tmp_path / "multirun" / "day" / "time" / "0"
    if own:
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"status": own, "steps": 3, "error": {"message": "x"}}))
    summary = slurm_end.record_lost_job(run_dir, "7_0", state, ["zero_stage=2"], "srun: Terminating StepId=8.0").to_json()
    assert summary["status"] == status and summary["slurm"]["state"] == (state or "unknown to SLURM")
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    expected = "x" if own == "failed" else "SLURM job 7_0 ended without a result"
    assert summary["error"]["message"].startswith(expected)
    if own == "interrupted":
        assert summary["steps"] == 3 and summary["error"]["job_status"] == "interrupted"
    (row,) = collect_runs([run_dir.parent])
    assert row["status"] == status and row["overrides"] == {"zero_stage": 2}  # read from .hydra/overrides.yaml


def test_a_job_whose_last_attempt_left_no_record_keeps_the_earlier_attempts_and_slurms_restart_count(tmp_path):
    """The summary in the folder is the first attempt's (restart 0); SLURM requeued the job twice and the last
    attempt ended before writing its own: the first attempt's summary stays its record, the job's is the lost
    attempt's, with SLURM's count of requeues."""
    run_dir = tmp_path / "multirun" / "day" / "time" / "0"
    (run_dir / "attempts" / "1").mkdir(parents=True)
    (run_dir / "attempts" / "1" / "summary.json").write_text(json.dumps({"status": "failed"}))
    first = {"status": "interrupted", "steps": 7, "slurm": {"job_id": "7", "array_job": "7_0", "restart_count": 0}}
    (run_dir / "summary.json").write_text(json.dumps(first))
    summary = slurm_end.record_lost_job(run_dir, "7_0", "FAILED", ["zero_stage=2"], "task 1: User defined signal 2",
                                        restarts=2).to_json()
    assert json.loads((run_dir / "attempts" / "2" / "summary.json").read_text()) == first
    assert summary["status"] == "failed" and "steps" not in summary
    assert summary["slurm"]["restart_count"] == 2 and summary["previous_attempts"] == ["attempts/1", "attempts/2"]
    again = slurm_end.record_lost_job(run_dir, "7_0", "FAILED", ["zero_stage=2"], "", restarts=2)  # its own: kept
    assert again.previous_attempts == ["attempts/1", "attempts/2"] and again.slurm["restart_count"] == 2


# ---- srun's account: the task that ended first -------------------------------------------------------------

# The job's stderr as the batch script and srun write it, over two attempts (lines as observed on the local cluster).
SRUN_STDERR = """zerotune: SLURM job 7, restart 0: the step starts
[default_role0]:[rank0]: RuntimeError: Connection reset by peer
srun: error: zt-node1: task 0: Exited with exit code 255
zerotune: SLURM job 7, restart 1: the step starts
submitit WARNING (2026-11-28 18:45:31,788) - Bypassing signal SIGCONT
srun: error: zt-node2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=7.0
slurmstepd-zt-node1: error: *** STEP 7.0 ON zt-node1 CANCELLED AT 2026-11-28T18:45:31 ***
srun: error: zt-node1: task 0: Exited with exit code 143
srun: Force Terminated StepId=7.0
"""


def test_srun_names_the_task_that_ended_first_in_each_attempt():
    last = slurm_end.first_task_end(SRUN_STDERR, restarts=1)
    assert (last.node, last.tasks, last.how) == ("zt-node2", "1", "Killed")  # not node 0's 143 that followed
    assert slurm_end.first_task_end(SRUN_STDERR) == last  # the last attempt's
    first = slurm_end.first_task_end(SRUN_STDERR, restarts=0)
    assert (first.node, first.how) == ("zt-node1", "Exited with exit code 255")
    assert slurm_end.first_task_end(SRUN_STDERR, restarts=2) is None  # that attempt's srun never started
    unmarked = "\n".join(line for line in SRUN_STDERR.splitlines() if not line.startswith("zerotune:"))
    assert slurm_end.first_task_end(unmarked, restarts=0) == first
    assert slurm_end.first_task_end(unmarked, restarts=1) is None  # the attempts cannot be told apart
    lost = slurm_end.first_task_end("srun: error: Node failure on zt-node2\nsrun: error: zt-node1: task 0: Killed")
    assert (lost.node, lost.tasks) == ("zt-node2", None)
    assert slurm_end.first_task_end("srun: Force Terminated StepId=7.0\n") is None


@pytest.mark.parametrize(("line", "ranks", "message", "extra"), [
    ("srun: error: zt-node2: task 1: Killed", [1],
     'the job process on zt-node2 (node 1) ended first, killed by SIGKILL (srun: "zt-node2: task 1: Killed")',
     {"failed_node_rank": 1, "signal": "SIGKILL"}),
    ("srun: error: zt-node1: task 0: Segmentation fault (core dumped)", [0],
     "the job process on zt-node1 (node 0) ended first, killed by SIGSEGV", {"signal": "SIGSEGV"}),
    ("srun: error: zt-node2: task 1: Exited with exit code 3", [1],
     "the job process on zt-node2 (node 1) ended first, with exit code 3", {"exit_code": 3}),
    ("srun: error: zt-node[1-2]: tasks 0-1: Out Of Memory", [0, 1],
     "the job process on zt-node[1-2] (nodes 0, 1) ended first: Out Of Memory", {"failed_node_ranks": [0, 1]}),
    ("srun: error: Node failure on zt-node2", [], "zt-node2 failed first", {}),
])
def test_the_task_that_ended_first_is_named_by_its_node(line, ranks, message, extra):
    record = slurm_end.first_task_end(line).record(ranks)
    assert record["message"].startswith(message) and record["failed_node"] in line
    assert record["srun"] == line and extra.items() <= record.items()


@pytest.fixture
def named_nodes(monkeypatch):
    """Node indices as `scontrol show hostnames zt-node[1-2]` gives them."""
    monkeypatch.setattr(slurm_end, "node_ranks", lambda node, nodelist, job_id: [int(node[-1]) - 1])


def lost_job(tmp_path: Path, own: dict | None, state: str = "FAILED") -> dict:
    run_dir = tmp_path / "0"
    if own is not None:
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(own))
    ended_first = slurm_end.first_task_end(SRUN_STDERR, restarts=1)
    return slurm_end.record_lost_job(run_dir, "7", state, [], "srun: Force Terminated StepId=7.0", restarts=1,
                                     ended_first=ended_first).to_json()


def test_a_job_whose_node_1_process_was_killed_is_recorded_failed_naming_node_1(tmp_path, named_nodes):
    """Node 1's job process killed: it wrote nothing; srun's SIGTERM stopped node 0's, which recorded itself
    interrupted, with its rank's error at the peer's loss."""
    own = {"status": "interrupted", "slurm": {"job_id": "7", "restart_count": 1, "nodelist": "zt-node[1-2]"},
           "error": {"type": "RuntimeError", "message": "Connection reset by peer"}}
    summary = lost_job(tmp_path, own)
    error = summary["error"]
    assert summary["status"] == "failed"
    assert error["message"] == ('SLURM job 7 ended without a result (state FAILED): the job process on zt-node2 '
                                '(node 1) ended first, killed by SIGKILL (srun: "zt-node2: task 1: Killed")')
    assert (error["failed_node"], error["failed_node_rank"], error["signal"]) == ("zt-node2", 1, "SIGKILL")
    assert error["job_status"] == "interrupted" and error["job_error"]["message"] == "Connection reset by peer"
    assert lost_job(tmp_path / "none", None)["error"]["failed_node_rank"] == 1  # no record of the job at all


def test_the_jobs_own_account_of_a_failed_node_stays_unless_that_node_recorded_nothing(tmp_path, named_nodes):
    killed_rank = {"status": "failed", "slurm": {"job_id": "7", "restart_count": 1},
                   "error": {"type": "failed", "message": "rank 1 on zt-node2 (node 1) was killed by SIGKILL",
                             "failed_node": "zt-node2", "failed_node_rank": 1}}
    assert lost_job(tmp_path, killed_rank)["error"] == killed_rank["error"]
    silent = {**killed_rank, "error": {"type": "failed", "failed_node": "zt-node1", "failed_node_rank": 0,
                                       "message": "rank 0 on zt-node1 (node 0) failed: Connection reset by peer; "
                                                  "node(s) 1 recorded nothing (lost, or killed whole)",
                                       "silent_nodes": [1]}}
    error = lost_job(tmp_path / "silent", silent)["error"]
    assert error["failed_node_rank"] == 1 and error["job_error"] == silent["error"]


def test_a_job_slurm_itself_ended_names_no_node(tmp_path, named_nodes):
    summary = lost_job(tmp_path, None, state="CANCELLED")
    assert summary["status"] == "cancelled" and "failed_node" not in summary["error"]
    assert summary["error"]["message"].endswith("srun: Force Terminated StepId=7.0")


def peer(folder: Path, k: int, status: str, **error) -> None:
    record = {"status": status, "node_rank": k, "node": f"zt-node{k + 1}"}
    if error:
        record["error"] = {"type": "failed", **error}
    (folder / f"summary.node{k}.json").write_text(json.dumps(record))


def rank0_failure(tmp_path: Path, at: float = 100.0) -> tuple[RunSummary, LaunchResult]:
    summary = RunSummary.from_json({"status": "failed",
                                    "error": {"type": "RuntimeError", "message": "Connection closed by peer"}})
    return summary, LaunchResult("failed", "rank 0 exited with code 1", failed_rank=0, exitcode=1, failed_at=at)


def test_the_killed_rank_on_another_node_is_named_first(tmp_path):
    peer(tmp_path, 1, "failed", message="rank 1 exited with code -9", failed_rank=1, exitcode=-9, failed_at=100.4)
    summary, result = rank0_failure(tmp_path)
    node_failures.name_failed_node(summary, result, "zt-node1", tmp_path, nnodes=2)
    error = summary.error
    assert error["message"] == "rank 1 on zt-node2 (node 1) was killed by SIGKILL"
    assert (error["failed_rank"], error["failed_node"], error["failed_node_rank"]) == (1, "zt-node2", 1)
    assert error["rank0_error"]["message"] == "Connection closed by peer"
    assert [n["node_rank"] for n in error["nodes"]] == [0, 1]


def test_node_0s_own_failure_leads_when_it_came_first(tmp_path):
    peer(tmp_path, 1, "failed", message="Connection reset", failed_rank=1, exitcode=1, failed_at=101.0)
    peer(tmp_path, 2, "ok")
    summary, result = rank0_failure(tmp_path, at=100.0)
    node_failures.name_failed_node(summary, result, "zt-node1", tmp_path, nnodes=3)
    assert summary.error["message"] == "rank 0 on zt-node1 (node 0) failed: Connection closed by peer"
    assert "rank0_error" not in summary.error and len(summary.error["nodes"]) == 2


def test_a_node_that_recorded_nothing_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(node_failures, "PEER_RECORD_WAIT_S", 0.0)
    peer(tmp_path, 1, "ok")
    summary, result = rank0_failure(tmp_path)
    node_failures.name_failed_node(summary, result, "zt-node1", tmp_path, nnodes=3)
    assert summary.error["silent_nodes"] == [2]
    assert summary.error["message"].endswith("node(s) 2 recorded nothing (lost, or killed whole)")


@pytest.mark.parametrize(("status", "nodes", "node_rank", "ends"), [
    ("failed", 2, 0, True), ("timeout", 2, 0, True), ("failed", 1, 0, False), ("failed", 2, 1, False),
    ("ok", 2, 0, False), ("interrupted", 2, 0, False),
])
def test_only_node_0_of_a_failed_multi_node_job_ends_the_step(status, nodes, node_rank, ends):
    assert ends_the_step(RunSummary.from_json({"status": status, "slurm": {"num_nodes": nodes}}), node_rank) is ends

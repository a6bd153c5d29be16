"""summary.json through RunSummary: the same JSON out as in, older files read, the status words in one place."""

from __future__ import annotations

import json
import re
import subprocess

from tests.helpers.cli import ROOT
from zerotune.rundir.summary import RunSummary, Status

# A summary as a job of an older version wrote it: keys this version knows, nulls, and one it does not know.
OLD = {"status": "oom", "choices": {"zero_stage": 2}, "run_dir": "/r", "experiment": None,
       "previous_attempts": [], "slurm": None, "loss_first": None, "steps": 3,
       "error": {"type": "OutOfMemoryError", "message": "CUDA out of memory"},
       "memory": {"gpu_peak_process_mib": 1.5, "per_rank": [{"rank": 0}]}, "retired_key": {"x": 1}}


def test_a_summary_reads_and_writes_back_the_same_json(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(OLD))
    summary = RunSummary.read(tmp_path)
    assert summary.status is Status.OOM and summary.steps == 3 and summary.memory["gpu_peak_process_mib"] == 1.5
    assert summary.extra == {"retired_key": {"x": 1}}
    (tmp_path / "again").mkdir()
    summary.write(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "summary.json").read_text()) == OLD


def test_a_field_never_set_is_absent_and_one_set_to_none_is_null():
    summary = RunSummary(status=Status.FAILED, run_dir="/r")
    assert summary.to_json() == {"status": "failed", "run_dir": "/r"}
    summary.loss_last = None
    summary.error = {"type": "x"}
    assert summary.to_json() == {"status": "failed", "run_dir": "/r", "error": {"type": "x"}, "loss_last": None}
    assert RunSummary.from_json({"status": Status.OK, "experiment": None}).to_json() == {"status": "ok", "experiment": None}


def test_an_older_or_partial_summary_reads():
    assert RunSummary.from_json({}).to_json() == {}
    assert RunSummary.from_json({"status": "ok"}).memory is None
    odd = RunSummary.from_json({"status": "someday"})  # a word this version does not know stays as written
    assert odd.status is None and odd.to_json() == {"status": "someday"}
    assert RunSummary.from_json({"status": None, "cls": 1}).to_json() == {"status": None, "cls": 1}
    assert RunSummary.read(ROOT / "no-such-folder") is None


def test_a_status_is_its_word():
    assert Status.PREDICTED_OOM == "predicted_oom" and f"{Status.OK}" == "ok"
    assert json.dumps({"status": Status.INTERRUPTED}) == '{"status": "interrupted"}'


def test_the_status_words_are_spelled_in_one_module():
    # "timeout", "cancelled" and "lost" are left out: "timeout" is a key of torch's rendezvous options too.
    statuses = set(Status) - {Status.TIMEOUT, Status.CANCELLED, Status.LOST}
    words = "|".join(re.escape(f'"{s.value}"') for s in statuses)
    found = subprocess.run(["grep", "-rnE", words, "src/", "--include=*.py"], cwd=ROOT, capture_output=True,
                           text=True).stdout.splitlines()
    # Not a status: doctor's count of failed checks.
    allowed = ("src/zerotune/rundir/summary.py:", "src/zerotune/cli/doctor_checks.py:")
    assert [line for line in found if not any(a in line for a in allowed)] == []

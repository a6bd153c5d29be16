"""summary.json's `plan` as a record (zerotune.rundir.plan): typed fields for its readers, the same JSON back."""

from __future__ import annotations

import json

from zerotune.config.schema import MIB
from zerotune.rundir.plan import Plan, Term

PLAN = {
    "workload": "model=tiny ...", "device": "cuda", "trainable_params": 10, "gpu": {"name": "l4", "memory_mib": 23034},
    "world_size": 2, "rank": 0, "trace": {"key": "k", "seconds": 0.5},
    "host_peak_mib": 12.0, "host_terms": [{"term": "model_load", "mib": 3.0, "note": "fp32 build"}],
    "nvme_mib": 0.0, "nvme_terms": [],
    "gpu_peak_mib": 300.0, "step_peak_moment": "step:update",
    "gpu_terms": [{"term": "cuda_context", "mib": 256.0, "note": "ada"},
                  {"term": "deepspeed:ipg_bucket", "mib": 4.0, "note": "", "moment": "persistent"},
                  {"term": "grads", "mib": 8.0, "note": "param.grad", "moment": "step:update"},
                  {"term": "activations", "mib": 32.0, "note": "trace", "moment": "forward+backward"}],
    "fits": True, "step_peak_mib": 300.0, "time_floor_s": None, "bound": None,
    "time_terms": [{"term": "compute", "seconds": None, "note": "unmeasured: no card named"}],
    "phases": [{"phase": "step", "peak_mib": 300.0, "terms": [], "source": "s", "carried_mib": 0.0,
                "reserved_mib": 300.0, "run_peak": True}],
    "run_peak_mib": 310.0, "run_peak_phase": "step",
    "host_fit": {"fits": True, "needed_mib": 1.0},
}


def test_a_plan_reads_typed_and_writes_back_the_same_json():
    plan = Plan.from_dict(PLAN)
    assert plan.gpu_peak_mib == 300.0 and plan.peak_mib == 310.0 and plan.time_terms[0].timed
    assert [t.term for t in plan.terms_at_peak()] == ["cuda_context", "deepspeed:ipg_bucket", "grads"]
    assert json.dumps(plan.to_dict()) == json.dumps(PLAN)  # key order included
    assert "host_terms" in plan and "step_terms" not in plan


def test_a_planner_error_and_no_plan():
    failed = Plan.from_dict({"error": "ValueError: no memory rule"})
    assert failed.error and failed.gpu_peak_mib is None and failed.to_dict() == {"error": "ValueError: no memory rule"}
    assert Plan.from_dict(None) is None and Plan.from_dict("garbage") is None


def test_a_term_made_of_bytes_keeps_them_exactly():
    term = Term.of_bytes("ipg_bucket", 3 * 10**9 + 7, "setup_buckets", "backward", where="gpu", bound="exact")
    assert term.nbytes == 3 * 10**9 + 7 and term.mib == (3 * 10**9 + 7) / MIB
    assert term.to_dict() == {"term": "ipg_bucket", "mib": term.mib, "note": "setup_buckets", "moment": "backward"}

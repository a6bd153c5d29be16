"""The memory guard on a CPU accelerator, where the device's memory is host memory: the planner's per-rank
peak for this node's ranks against what the host has available (plan.guard refuses by default), and a worker
the kernel's OOM killer ends (SIGKILL under memory pressure) recorded as a host out-of-memory failure."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.cli import ROOT, cli_env, compose_cfg, read_summary, run_cli
from tests.helpers.fixes import check_fix
from tests.test_faults import steps_logged, wait_for, workers_of
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.config.schema import Plan
from zerotune.host.platform import Platform
from zerotune.host.ram import HostExit, HostMemory, HostSample, near_limit, read_host_memory
from zerotune.job.elastic import LaunchResult
from zerotune.job.records import host_oom_error
from zerotune.plan import guard as planning
from zerotune.plan.host_memory import node_need_mib
from zerotune.report import collect, plots
from zerotune.report.budget import budget_answer
from zerotune.rundir.plan import Plan as Prediction
from zerotune.rundir.plan import Term
from zerotune.rundir.summary import RunSummary

SDXL = ("model=sdxl", "data=synthetic", "resolution=128", "train.batch_size=1")
TINY = ("evaluate.enabled=false", "scheduler=constant", "train.batch_size=8", "train.log_every=1")


def _term(name: str, mib: float) -> Term:
    return Term(name, mib, "")


# One rank on a CPU accelerator: 2,000 + 2,000 + 1,500 + 500 device MiB (the CUDA-only terms left out) beside a
# 1,000 MiB EMA on the host = 7,000 MiB; the fp32 build (3,000 MiB) comes first and is smaller.
PLAN = Prediction.made(gpu_peak_mib=6100.0, trainable_params=2_567_463_684, frozen_params=0,  # SDXL's U-Net
                       gpu_terms=[_term("cuda_context", 400), _term("params", 2000), _term("grads", 2000),
                                  _term("optimizer_states", 1500), _term("activations", 500),
                                  _term("allocator_rounding", 100)],
                       host_terms=[_term("ema", 1000), _term("model_load", 3000)])


def _cfg(guard="refuse", ranks=1, host_mib=None, adapter="none"):
    return OmegaConf.create({"plan": {"guard": guard, "gpu": None, "gpu_mib": None, "host_mib": host_mib,
                                      "only": False},
                             "launch": {"num_processes": ranks}, "model": {"name": "sdxl"},
                             "adapter": {"name": adapter}, "offload": {"device": "none"}})


@pytest.fixture
def cpu_host(monkeypatch):
    """A CPU accelerator on a 24,000 MiB host; `set(available)` chooses what it has available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(planning, "detect", lambda: Platform("cpu", True, "", bf16=True, fp16=False))

    def set_available(mib: float) -> None:
        monkeypatch.setattr(planning, "read_host_memory", lambda: HostMemory(24000.0, float(mib)))

    set_available(20000)
    return set_available


def _guarded(cfg, plan=PLAN):
    plan = plan.adding(host_fit=planning.host_fit(cfg, plan))
    return planning.guard(cfg, plan), plan


# ------------------------------------------------------------------------------------------ the need


def test_a_cpu_rank_holds_its_device_terms_in_host_memory():
    assert node_need_mib(PLAN, 1, "cpu") == pytest.approx(7000)
    assert node_need_mib(PLAN, 3, "cpu") == pytest.approx(21000)     # every rank on the node holds its own
    assert node_need_mib(PLAN, 2, "cuda") == pytest.approx(6000)     # on a GPU the host holds the host terms
    assert node_need_mib(Prediction.made(error="planner failed"), 1, "cpu") is None


def test_the_default_guard_refuses():
    assert compose_cfg().plan.guard == "refuse" and Plan().guard == "refuse"
    assert compose_cfg().plan.host_mib is None


# ------------------------------------------------------------------------------------------ the decision


def test_refuse_names_both_figures_and_the_fixes(cpu_host):
    cpu_host(5000)
    with pytest.raises(ConfigError) as err:
        _guarded(_cfg("refuse"))
    assert err.value.key == "plan.guard"
    assert "predicted peak 7,000 MiB" in err.value.problem and "the 5,000 MiB available" in err.value.problem
    assert "CPU accelerator" in err.value.problem
    for fix in ("adapter=lora", "offload=nvme offload.path=", "model=tiny", "plan.only=true", "plan.guard=warn"):
        assert fix in err.value.fix, fix
    # a smaller model is offered where its parameters, scaled, fit the room; never a larger one
    assert "model=sd15;" in err.value.fix and "model=sdxl;" not in err.value.fix
    assert "launch.num_processes" not in err.value.fix  # one rank: nothing to gain


def test_warn_and_skip_act_as_on_cuda(cpu_host, caplog):
    cpu_host(5000)
    assert _guarded(_cfg("warn"))[0] is None
    assert "predicted peak 7,000 MiB" in caplog.text and "plan.guard=warn" in caplog.text
    decision, plan = _guarded(_cfg("skip"))
    assert decision == "predicted_oom" and plan.host_fit["fits"] is False


def test_a_prediction_that_fits_passes(cpu_host):
    cpu_host(7100)
    decision, plan = _guarded(_cfg("refuse"))
    assert decision is None and plan.host_fit["fits"] is True
    assert plan.host_fit["needed_mib"] == pytest.approx(7000) and plan.host_fit["available_mib"] == 7100


def test_ranks_on_a_node_add_up(cpu_host):
    cpu_host(10000)
    assert _guarded(_cfg("refuse", ranks=1))[0] is None
    with pytest.raises(ConfigError) as err:
        _guarded(_cfg("refuse", ranks=2))
    assert "14,000 MiB" in err.value.problem and "2 rank(s)" in err.value.problem
    assert "launch.num_processes=1" in err.value.fix


def test_plan_host_mib_gives_the_job_less_than_the_host_has(cpu_host):
    with pytest.raises(ConfigError) as err:
        _guarded(_cfg("refuse", host_mib=6000))
    assert "the 6,000 MiB plan.host_mib gives the job" in err.value.problem


@pytest.mark.parametrize("bad", [0, -5, True, "lots"])
def test_plan_host_mib_must_be_a_positive_number(bad):
    with pytest.raises(ConfigError) as err:
        planning.check_plan_keys(OmegaConf.create({"guard": "refuse", "host_mib": bad}))
    assert err.value.key == "plan.host_mib"


def test_no_figures_nothing_to_guard(cpu_host):
    cpu_host(1)
    assert planning.guard(_cfg("refuse"), Prediction.made(gpu_peak_mib=10**9)) is None  # no host_fit: the planner failed


def test_this_hosts_memory_is_read():
    memory = read_host_memory()
    assert 0 < memory.available_mib <= memory.total_mib
    assert memory.limit_mib <= memory.total_mib and memory.headroom_mib <= memory.available_mib


# ------------------------------------------------------------------------------------------ the real CLI


def test_sdxl_on_this_host_is_refused_in_seconds_before_any_worker_trains(tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = run_cli(*SDXL, "train.max_steps=2", f"hydra.run.dir={run_dir}", timeout=300)
    took = time.monotonic() - start
    assert proc.returncode == CONFIG_ERROR_EXIT, proc.stderr[-3000:]
    assert "config error at `plan.guard`" in proc.stderr and "Traceback" not in proc.stderr
    predicted = float(re.search(r"predicted peak ([\d,]+) MiB", proc.stderr).group(1).replace(",", ""))
    available = float(re.search(r"the ([\d,]+) MiB available", proc.stderr).group(1).replace(",", ""))
    assert predicted > available and predicted > 40_000  # SDXL's fp32 states alone are 4 x 9,794 MiB
    assert "plan.only=true" in proc.stderr and "plan.guard=warn" in proc.stderr
    output = proc.stdout + proc.stderr
    assert "step 1/" not in output and "ChildFailedError" not in output
    for trained in ("metrics.jsonl", "ranks", "ds_config.json"):
        assert not (run_dir / trained).exists(), trained
    assert not list(run_dir.glob("checkpoints/step-*"))
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["error"]["key"] == "plan.guard"
    fit = summary["plan"]["host_fit"]
    assert fit["fits"] is False and round(fit["needed_mib"]) == predicted and fit["accelerator"] == "cpu"
    assert took < 60, took
    print(f"refused in {took:.1f} s: predicted {predicted:,.0f} MiB, available {available:,.0f} MiB")


def test_plan_only_is_never_refused_and_records_the_fit(tmp_path):
    proc = run_cli(*SDXL, "plan.only=true", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "planned" and summary["plan"]["host_fit"]["fits"] is False
    assert not (tmp_path / "run" / "logs").exists(), "no worker was started"


def test_every_fix_that_can_be_typed_passes_the_guard(monkeypatch):
    """The fix line's alternatives, applied to the refused overrides, pass the same checks on a host with
    SDXL's refusal (20,000 MiB available, as on this 24 GiB machine when idle)."""
    from tests.helpers.cli import preflight

    monkeypatch.setattr(planning, "read_host_memory", lambda: HostMemory(24105.0, 20000.0))

    def passes(overrides: list[str]) -> None:
        cfg = compose_cfg(*overrides)
        checked = preflight(cfg, overrides=overrides)
        if cfg.plan.only:  # a plan.only job predicts and trains nothing: the guard is not asked
            return
        planning.guard(cfg, planning.job_plan(checked, planning.job_gpu(cfg)))

    with pytest.raises(ConfigError) as err:
        passes(list(SDXL))
    assert err.value.key == "plan.guard"
    applied = check_fix(err.value, list(SDXL), passes)
    assert applied >= 5, err.value.fix  # adapter=lora, model=sdxl_tiny, model=tiny, plan.only, plan.guard=warn


# ------------------------------------------------------------------------------------------ OOM kills


def _sample(rss: float, available: float, total: float = 24000.0, t: float = 0.0) -> HostSample:
    return HostSample(t, rss, HostMemory(total, available))


def test_near_limit_reads_the_headroom_and_the_workers_rss():
    assert near_limit([_sample(2000, 15000), _sample(2100, 14000)]) is None
    low = near_limit([_sample(2000, 15000), _sample(23500, 180)])
    assert low["available_mib"] == 180 and low["tree_rss_mib"] == 23500 and low["near"] == "host memory available"
    # the workers at the host's limit while other memory is reclaimable (available still above the margin)
    assert near_limit([_sample(23200, 2000)])["near"] == "the workers' RSS (23,200 MiB) against the host's 24,000 MiB"
    budget = near_limit([_sample(900, 15000)], budget_mib=1000)
    assert budget["budget_mib"] == 1000 and budget["gap_mib"] == 100
    assert budget["near"] == "the workers' RSS (900 MiB) against plan.host_mib (1,000 MiB)"
    assert near_limit([_sample(500, 15000)], budget_mib=1000) is None
    assert near_limit([]) is None


def _killed(samples, exitcode=-signal.SIGKILL, oom_kills=0, kernel_log=False) -> LaunchResult:
    return LaunchResult("failed", f"rank 0 exited with code {exitcode}", failed_rank=0, failed_local_rank=0,
                        exitcode=exitcode, host=HostExit(samples, oom_kills, kernel_log))


SUMMARY = RunSummary(plan=Prediction.made(host_fit={"needed_mib": 30000.0, "budget_mib": None}))


def test_a_sigkill_under_memory_pressure_is_a_host_oom():
    error = host_oom_error(_killed([_sample(1000, 15000), _sample(23600, 120)]), SUMMARY,
                           {"host_peak_rss_mib": 23650.0})
    assert error["type"] == "HostOutOfMemory" and error["kind"] == "host"
    assert error["predicted_mib"] == 30000.0 and error["peak_rss_mib"] == 23650.0
    assert error["available_mib"] == 120 and error["total_mib"] == 24000.0
    assert error["message"].startswith("predicted 30,000 MiB, peak RSS 23,650 MiB, 120 MiB available of 24,000 MiB")
    assert "host memory available: 120 MiB left" in error["message"]


def test_a_sigkill_with_memory_to_spare_is_not_an_oom():
    calm = [_sample(1000, 15000), _sample(1100, 14900)]
    assert host_oom_error(_killed(calm), SUMMARY, {"host_peak_rss_mib": 1100.0}) is None
    assert host_oom_error(_killed([_sample(23600, 120)], exitcode=1), SUMMARY, {"host_peak_rss_mib": 1.0}) is None
    assert host_oom_error(_killed([_sample(23600, 120)], exitcode=-signal.SIGSEGV), SUMMARY, {}) is None


def test_the_kernels_own_record_is_enough():
    calm = [_sample(1000, 15000)]
    by_cgroup = host_oom_error(_killed(calm, oom_kills=1), SUMMARY, {"host_peak_rss_mib": 1000.0})
    assert by_cgroup["kind"] == "host" and "the cgroup counted 1 OOM kill(s)" in by_cgroup["message"]
    by_log = host_oom_error(_killed(calm, kernel_log=True), RunSummary(), {"host_peak_rss_mib": None})
    assert by_log["predicted_mib"] is None and by_log["peak_rss_mib"] is None
    assert by_log["message"].startswith("no prediction, peak RSS unmeasured, 15,000 MiB available of 24,000 MiB")
    assert "the kernel's log names the worker as OOM-killed" in by_log["message"]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY, "train.max_steps=100000",
                             f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_a_worker_after_a_step(run_dir: Path, job: subprocess.Popen) -> str:
    wait_for(lambda: steps_logged(run_dir) >= 1, timeout=180, what="a step")
    workers_of(run_dir)[0].send_signal(signal.SIGKILL)
    _, err = job.communicate(timeout=180)
    assert job.returncode == 1, err[-3000:]
    return err


@pytest.mark.slow
def test_a_worker_killed_at_its_memory_limit_is_recorded_as_a_host_oom(tmp_path):
    """plan.host_mib=64 stands in for a host with 64 MiB for the job: the guard refuses in seconds, plan.guard=warn
    runs it anyway, and the worker (hundreds of MiB: at its limit) is then sent SIGKILL, as the kernel's OOM
    killer would."""
    refused = run_cli(*TINY, "train.max_steps=2", "plan.host_mib=64", f"hydra.run.dir={tmp_path / 'refused'}")
    assert refused.returncode == CONFIG_ERROR_EXIT and "the 64 MiB plan.host_mib gives the job" in refused.stderr
    run_dir = tmp_path / "run"
    err = _kill_a_worker_after_a_step(run_dir, _start(run_dir, "plan.host_mib=64", "plan.guard=warn"))
    assert "Traceback" not in err
    summary = read_summary(run_dir)
    error = summary["status"], summary["error"]
    assert summary["status"] == "oom" and summary["error"]["kind"] == "host", error
    error = summary["error"]
    assert error["predicted_mib"] == pytest.approx(summary["plan"]["host_fit"]["needed_mib"])
    assert error["peak_rss_mib"] > 64 and error["budget_mib"] == 64 and error["total_mib"] > 1000
    assert error["available_mib"] > 0 and error["exitcode"] == -signal.SIGKILL
    assert "against plan.host_mib (64 MiB)" in error["message"] and "MiB over" in error["message"]
    # A sweep's report reads it as a memory failure.
    (row,) = collect.collect_runs([run_dir])
    assert row["status"] == "oom" and row["oom_kind"] == "host" and row["error"].startswith("HostOutOfMemory: predicted")
    assert plots.unfinished_label(row) == "host OOM"
    assert "(1 oom (host))" in budget_answer([row], 24576, metric="host_peak_rss_mib").reason


@pytest.mark.slow
def test_a_worker_killed_with_memory_to_spare_stays_failed(tmp_path):
    run_dir = tmp_path / "run"
    err = _kill_a_worker_after_a_step(run_dir, _start(run_dir))
    summary = read_summary(run_dir)
    assert summary["status"] == "failed", summary["error"]
    assert "exited with code -9" in summary["error"]["message"] and "kind" not in summary["error"]
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------ reports


def _write(job: Path, status: str, error: dict) -> None:
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"status": status, "error": error, "choices": {"zero_stage": 2}}))


def test_reports_tell_a_host_oom_from_a_gpu_oom(tmp_path):
    _write(tmp_path / "0", "oom", {"type": "HostOutOfMemory", "kind": "host", "message": "predicted 9 MiB"})
    _write(tmp_path / "1", "oom", {"type": "OutOfMemoryError", "message": "CUDA out of memory"})
    _write(tmp_path / "2", "failed", {"type": "failed", "message": "rank 0 exited with code -9"})
    rows = {r["job"]: r for r in collect.collect_runs([tmp_path])}
    assert [rows[j]["oom_kind"] for j in "012"] == ["host", "gpu", None]
    assert [plots.unfinished_label(rows[j]) for j in "012"] == ["host OOM", "OOM", "failed"]
    assert collect.status_word(rows["0"]) == "oom (host)" and collect.status_word(rows["1"]) == "oom"


def test_a_cpu_allocation_failure_is_recorded_as_out_of_memory():
    import torch

    from zerotune.rundir.summary import is_oom

    with pytest.raises(RuntimeError) as err:
        torch.empty(2**62, dtype=torch.uint8)  # more than any machine has: refused at once, nothing allocated
    assert is_oom(err.value)
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_no_other_model_is_offered_for_a_runs_own_weights(cpu_host):
    cpu_host(5000)
    cfg = _cfg("refuse")
    cfg.model.components = "/models/sdxl"
    with pytest.raises(ConfigError) as err:
        _guarded(cfg)
    assert "model=" not in err.value.fix and "adapter=lora" in err.value.fix

"""What reaches the console: zerotune's lines and errors; libraries' chatter goes to the run's log files."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch

from tests.helpers.cli import run_cli
from zerotune.host import process

# A line of zerotune's own logger, in the job process or a rank's (torch's launcher prefixes a rank's lines).
OWN_LINE = re.compile(r"^(\[default_role\d+\]:)?\[[\d :,-]+\]\[(zerotune|hydra_plugins)(\.[\w.]+)?\]\[(INFO|WARNING|ERROR)\] - ")
# Lines the console may hold besides zerotune's own: none today. A line added here must be about the user's run.
WHITELIST: tuple[re.Pattern, ...] = ()


@pytest.fixture
def root_streams():
    """The root logger split as a process's is (console.split_console_and_log), restored after."""
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    root.handlers.clear()
    shown, logged = io.StringIO(), io.StringIO()
    process.split_console_and_log(shown, logged)
    yield shown, logged
    root.handlers[:], root.level = before
    logging.captureWarnings(False)


def test_the_console_keeps_zerotunes_lines_and_libraries_errors(root_streams):
    shown, logged = root_streams
    logging.getLogger("zerotune.plan").warning("figure unmeasured")
    logging.getLogger("accelerate.checkpointing").info("Random states saved")
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
    logging.getLogger("some_library").error("a library's error")
    assert shown.getvalue().count("\n") == 2
    assert "figure unmeasured" in shown.getvalue() and "a library's error" in shown.getvalue()
    for line in ("figure unmeasured", "Random states saved", "gemm_4bit_forward", "a library's error"):
        assert line in logged.getvalue()


def test_a_library_printing_through_its_own_handler_goes_to_the_log(root_streams):
    """DeepSpeed's logger prints to stdout through a handler of its own and does not propagate; the filter set on
    it beforehand, which DeepSpeed keeps, hands its records to the root's handlers instead."""
    shown, logged = root_streams
    own = io.StringIO()
    deepspeed = logging.getLogger("DeepSpeed")
    handler = logging.StreamHandler(own)  # as DeepSpeed's LoggerFactory adds it, after the filter
    deepspeed.addHandler(handler)
    propagate, deepspeed.propagate = deepspeed.propagate, False
    try:
        deepspeed.warning("Setting accelerator to CPU.")
        deepspeed.error("an error of DeepSpeed's")
    finally:
        deepspeed.removeHandler(handler)
        deepspeed.propagate = propagate
    assert own.getvalue() == ""
    assert "Setting accelerator to CPU." in logged.getvalue() and "Setting accelerator" not in shown.getvalue()
    assert "an error of DeepSpeed's" in shown.getvalue()


def test_the_default_jobs_console_holds_zerotunes_lines_only(tmp_path):
    """The default job, shortened: every console line is zerotune's (or whitelisted); what the libraries said on
    the way is in main.log (the job process) and the rank's stdout.log."""
    proc = run_cli("train.max_steps=20", "train.log_every=10", "evaluate.per_class=2", "evaluate.steps=2",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    foreign = [line for line in lines if not OWN_LINE.match(line) and not any(p.search(line) for p in WHITELIST)]
    assert not foreign, "\n".join(foreign)
    assert any("result: status ok" in line for line in lines)
    job_log = (tmp_path / "main.log").read_text()
    rank_log = next((tmp_path / "logs").glob("*/attempt_0/0/stdout.log")).read_text()
    if not torch.cuda.is_available():  # DeepSpeed says so where it finds no GPU
        assert "[DeepSpeed][WARNING] - Setting accelerator to CPU" in job_log
    assert "learning rate from scheduler before it has started" in rank_log
    assert "step 20/20" in rank_log and "step 20/20" in proc.stdout + proc.stderr


def test_a_command_without_a_run_folder_keeps_libraries_out_of_its_output(tmp_path):
    """`zerotune plan` prints its plan; what DeepSpeed says on its import goes to the command's log in the cache."""
    proc = run_cli("plan", "model=tiny", module="zerotune", env={"ZEROTUNE_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("workload: model=tiny")
    assert "DeepSpeed" not in proc.stderr and "[WARNING]" not in proc.stderr, proc.stderr
    if not torch.cuda.is_available():
        assert "Setting accelerator to CPU" in (tmp_path / "logs" / "plan.log").read_text()

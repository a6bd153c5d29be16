"""Compose configs in-process, and run the real CLI as a subprocess (or a command's main in-process)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from zerotune.config.compose import compose

if TYPE_CHECKING:
    from zerotune.config.schema import Config
    from zerotune.host.platform import Platform
    from zerotune.plan.resolve import ResolvedRun

ROOT = Path(__file__).resolve().parents[2]


def compose_cfg(*overrides: str):
    """The config train.py would compose from these overrides (a ConfigError where it would exit 2)."""
    return compose(list(overrides))


def config_of(*overrides: str) -> Config:
    """The config train.py would compose from these overrides, typed as every function past the command line takes
    it (not settled: the user's files are not read)."""
    from zerotune.config.compose.settle import to_config

    return to_config(compose(list(overrides)))


def preflight(cfg, world_size: int | None = None, platform: Platform | None = None, overrides: list[str] | tuple = (),
              run_dir: str | Path | None = None) -> ResolvedRun:
    """A composed config settled and checked, as a job's command line does (cli/train.py, then the job's checks);
    `overrides`: those typed on the command line."""
    from zerotune.config.compose.settle import settle
    from zerotune.plan.resolve import check

    return check(settle(cfg, overrides, world_size), platform, run_dir)


def cli_env() -> dict:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str, cwd: Path = ROOT, timeout: int = 900, module: str | None = None, env: dict | None = None):
    """Run `python train.py ARGS` (the checkout's `zerotune train`; or `python -m MODULE ARGS`) and return the
    CompletedProcess; `env` is set on top of the test's environment."""
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(ROOT / "train.py")]
    return subprocess.run([*cmd, *args], cwd=cwd, env={**cli_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def call_main(main, *args: str) -> subprocess.CompletedProcess:
    """An argparse command's `main(argv)` run in this process, answered as `run_cli` answers: for tests of what
    a command says and returns, a few seconds of imports cheaper than a new process. That each command starts as a
    process of its own is tests/test_console_scripts.py's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors; sys.exit(None) is 0, sys.exit("why") is 1
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["main", *args], code, out.getvalue(), err.getvalue())


def read_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss/train"] for r in rows]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def stop_process(proc: subprocess.Popen) -> None:
    """A server a test started, stopped by its pid: SIGTERM, then SIGKILL if it has not gone in 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def wait_for(predicate, timeout: float = 120, what: str = "condition"):
    """`predicate()`'s first truthy answer, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")

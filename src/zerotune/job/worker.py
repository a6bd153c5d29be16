"""One training process of a job, started through job/bootstrap.py: it imports while the parent checks the job,
waits at the gate, then trains the run the parent resolved (resolved.json) with torch.distributed's rank."""

from __future__ import annotations

import os

# Imported here rather than in setup: diffusers' model modules take ~2 s, spent while the parent checks the job.
from diffusers import UNet2DConditionModel  # noqa: F401
from torch.distributed.elastic.multiprocessing.errors import record

from zerotune.config.errors import ConfigError, report_config_error
from zerotune.job.gate import GateWatch
from zerotune.plan.resolve import ResolvedRun
from zerotune.rundir import JobSpec
from zerotune.train.run import train


def main(run_dir: str, gate: GateWatch) -> int:
    return record(_main)(run_dir, gate) or 0  # an exception reaches the launcher's report (error.message in the summary)


def _main(run_dir: str, gate: GateWatch) -> int:
    waited = gate.wait_for_go()  # a refused job ends this process in there
    spec = JobSpec.load(run_dir)
    run = ResolvedRun.load(run_dir, int(os.environ.get("GROUP_RANK", 0)))  # torch's elastic agent: this node
    try:
        train(run, spec, waited)
    except ConfigError as exc:
        return report_config_error(exc)
    return 0

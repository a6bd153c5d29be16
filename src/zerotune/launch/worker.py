"""One training process of a job, started by the launcher through launch/bootstrap.py.

It reads the config the parent resolved (so every rank trains the same thing, in the same folder)
and trains with the rank torch.distributed's environment gives it.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from zerotune import schema
from zerotune.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.rundir import CONFIG
from zerotune.rundir.spec import JobSpec
from zerotune.training.run import train


def main(run_dir: str) -> int:
    return record(_main)(run_dir)  # an exception reaches the launcher's report (error.message in the summary)


def _main(run_dir: str) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    spec = JobSpec.load(run_dir)
    cfg = schema.typed(OmegaConf.load(f"{run_dir}/{CONFIG}"))
    try:
        train(cfg, spec)
    except ConfigError as exc:
        print(f"zerotune: config error at {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    return 0

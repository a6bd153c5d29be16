"""One training process of a job: `python -m zerotune.launch.worker <run_dir>`, started by the launcher.

It reads the config the parent resolved (so every rank trains the same thing, in the same folder)
and trains with the rank torch.distributed's environment gives it.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import OmegaConf

from zerotune import schema
from zerotune.errors import CONFIG_ERROR_EXIT, ConfigError
from zerotune.rundir import CONFIG
from zerotune.rundir.spec import JobSpec


def die_with_parent() -> None:
    """Linux: if the job's process is killed (even with SIGKILL), its workers go too, never training on alone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(run_dir: str) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    die_with_parent()

    return record(_main)(run_dir)  # an exception reaches the launcher's report (error.message in the summary)


def _main(run_dir: str) -> int:
    # Imported here, not at the top: the heavy imports (torch, DeepSpeed) come after die_with_parent().
    from zerotune.training.run import train

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    spec = JobSpec.load(run_dir)
    cfg = schema.typed(OmegaConf.load(f"{run_dir}/{CONFIG}"))
    try:
        train(cfg, spec)
    except ConfigError as exc:
        print(f"zerotune: config error at {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

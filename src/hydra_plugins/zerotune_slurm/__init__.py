"""`hydra/launcher=zerotune_slurm`, what conf/hydra/launcher/slurm.yaml builds on: hydra-submitit-launcher's SLURM
launcher and config, with three changes.

- `srun_args`, submitit's, which the plugin's config does not expose (slurm.yaml sets --kill-on-bad-exit=1).
- The task srun starts on each node is submitit's, through zerotune/job/slurm_task.py: a stop signal that
  comes while it starts (a pre-emption soon after a requeue) is held for the job, not the death of the task;
  and the batch script's shell ignores the pre-emption signal.
- How a job's end is awaited. The plugin's `launch` ends in `[j.results()[0] for j in jobs]`: that waits forever
  on a job that ended without a result where there is no `sacct` (zerotune/job/slurm_launcher.py), and the first
  job that failed raises, which ends the sweep. Here each job is waited on until it wrote its result or left
  SLURM's queue; one that ended without a result (cancelled, killed, its node lost) is recorded in its run
  folder's summary.json with SLURM's state, and the sweep goes on to the next.

Hydra takes launchers from the hydra_plugins package only, and imports every module in it; without the `slurm`
extra there is nothing to extend, and nothing is registered.
"""

# No `from __future__ import annotations`: Hydra executes this module without registering it in sys.modules,
# where dataclasses look string annotations up.
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from omegaconf import open_dict

log = logging.getLogger("zerotune.job.slurm_launcher")

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # pip install 'zerotune[slurm]'
    submitit_launcher = None

if submitit_launcher is not None:
    from zerotune.job import slurm_launcher

    @dataclass
    class ZerotuneSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.zerotune_slurm.SlurmLauncher"
        srun_args: list[str] = field(default_factory=list)  # passed to the `srun` that starts each node's task

    ConfigStore.instance().store(group="hydra/launcher", name="zerotune_slurm", node=ZerotuneSlurmConf,
                                 provider="zerotune")

    class SlurmLauncher(submitit_launcher.SlurmLauncher):
        """hydra-submitit-launcher's, each job waited on until it wrote its result or left SLURM's queue
        (zerotune/job/slurm_launcher.py)."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            jobs = slurm_launcher.submitted(lambda: super(SlurmLauncher, self).launch(job_overrides,
                                                                                         initial_job_idx))
            return [slurm_launcher.outcome(job, list(overrides), partial(self._job_run_dir, list(overrides), i))
                    for i, (job, overrides) in enumerate(zip(jobs, job_overrides, strict=True), initial_job_idx)]

        def _job_run_dir(self, overrides: list[str], idx: int) -> Path:
            """The job's run folder, as Hydra names it inside the job (hydra.sweep.dir / hydra.sweep.subdir)."""
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            try:
                job_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
                with open_dict(job_config.hydra.job):
                    job_config.hydra.job.num = idx
                return sweep_dir / str(job_config.hydra.sweep.subdir)
            except Exception as exc:  # a subdir naming what only the job knows (hydra.job.id, say)
                log.warning("hydra.sweep.subdir does not resolve here (%s): job %d recorded in %s/%d", exc, idx,
                            sweep_dir, idx)
                return sweep_dir / str(idx)

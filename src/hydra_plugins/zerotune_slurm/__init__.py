"""`hydra/launcher=zerotune_slurm`, what conf/hydra/launcher/slurm.yaml builds on: hydra-submitit-launcher's SLURM
launcher and config, with three changes.

- `srun_args`, submitit's, which the plugin's config does not expose (slurm.yaml sets --kill-on-bad-exit=1).
- The task srun starts on each node is submitit's, through zerotune/launch/slurm_task.py: a stop signal that
  comes while it starts (a pre-emption soon after a requeue) is held for the job, not the death of the task;
  and the batch script's shell ignores the pre-emption signal.
- How a job's end is awaited. The plugin's `launch` ends in `[j.results()[0] for j in jobs]`: that waits forever
  on a job that ended without a result where there is no `sacct` (zerotune/launch/slurm_end.py), and the first
  job that failed raises, which ends the sweep. Here each job is waited on until it wrote its result or left
  SLURM's queue; one that ended without a result (cancelled, killed, its node lost) is recorded in its run
  folder's summary.json with SLURM's state, and the sweep goes on to the next.

Hydra takes launchers from the hydra_plugins package only, and imports every module in it; without the `slurm`
extra there is nothing to extend, and nothing is registered.
"""

# No `from __future__ import annotations`: Hydra executes this module without registering it in sys.modules,
# where dataclasses look string annotations up.
import logging
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import open_dict

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from submitit.slurm.slurm import SlurmExecutor, SlurmJobEnvironment, _make_sbatch_string
except ImportError:  # pip install 'zerotune[slurm]'
    submitit_launcher = None

log = logging.getLogger(__name__)

if submitit_launcher is not None:
    from zerotune.launch.slurm_end import job_restarts, record_lost_job, stderr_tail, wait_for_end

    @dataclass
    class ZerotuneSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.zerotune_slurm.SlurmLauncher"
        srun_args: list[str] = field(default_factory=list)  # passed to the `srun` that starts each node's task

    ConfigStore.instance().store(group="hydra/launcher", name="zerotune_slurm", node=ZerotuneSlurmConf,
                                 provider="zerotune")

    def task_command(executor) -> str:
        """What srun runs on each node: submitit's task, its stop signals held from its first line."""
        return " ".join([executor.python, "-u -m zerotune.launch.slurm_task", shlex.quote(str(executor.folder))])

    def batch_script(executor, command: str, uid: str) -> str:  # noqa: ARG001 (submitit's signature)
        """submitit's sbatch script, whose shell ignores the pre-emption signal: SLURM signals the shell too when
        asked to (`scancel --full`), and the shell, which only waits on srun, would end the job FAILED of it."""
        setup = [f"trap '' {SlurmJobEnvironment.USR_SIG}", *(executor.parameters.get("setup") or [])]
        return _make_sbatch_string(command=command, folder=executor.folder, **{**executor.parameters, "setup": setup})

    class SlurmLauncher(submitit_launcher.SlurmLauncher):
        """hydra-submitit-launcher's, each job waited on until it wrote its result or left SLURM's queue."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
            jobs = self._submitted(job_overrides, initial_job_idx)
            return [self._outcome(job, list(overrides), initial_job_idx + i)
                    for i, (job, overrides) in enumerate(zip(jobs, job_overrides, strict=True))]

        def _submitted(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
            """The plugin's own submission (its executor, parameters and logging), with its jobs kept and not
            waited on: its `launch` minus the last line, without copying it."""
            import submitit

            captured: list = []
            real_map_array = submitit.AutoExecutor.map_array

            def map_array(executor, fn, *iterables):
                captured.extend(real_map_array(executor, fn, *iterables))
                return []  # the plugin then waits on no job: `_outcome` does, one by one

            with patch.object(submitit.AutoExecutor, "map_array", map_array), \
                    patch.object(SlurmExecutor, "_submitit_command_str", property(task_command)), \
                    patch.object(SlurmExecutor, "_make_submission_file_text", batch_script):
                super().launch(job_overrides, initial_job_idx)
            return captured

        def _outcome(self, job, overrides: list[str], idx: int) -> JobReturn:
            state = wait_for_end(job)
            failure = ""
            if state == "COMPLETED":
                try:
                    return job.results()[0]
                except Exception as exc:  # submitit's FailedJobError: the task raised past Hydra (its traceback)
                    failure = str(exc).strip().splitlines()[-1][:500]
            run_dir = self.job_run_dir(overrides, idx)
            detail = failure or stderr_tail(job, lines=1)
            summary = record_lost_job(run_dir, str(job.job_id), None if state == "COMPLETED" else state, overrides,
                                      detail, restarts=job_restarts(str(job.job_id)))
            # COMPLETED, as zerotune's own task returns for a job that failed in a sweep: recorded, and the sweep goes on.
            return JobReturn(overrides=overrides, working_dir=str(run_dir), status=JobStatus.COMPLETED,
                             _return_value=summary)

        def job_run_dir(self, overrides: list[str], idx: int) -> Path:
            """The job's run folder, as Hydra names it inside the job (hydra.sweep.dir / hydra.sweep.subdir)."""
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            try:
                config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
                with open_dict(config.hydra.job):
                    config.hydra.job.num = idx
                return sweep_dir / str(config.hydra.sweep.subdir)
            except Exception as exc:  # a subdir naming what only the job knows (hydra.job.id, say)
                log.warning("hydra.sweep.subdir does not resolve here (%s): job %d recorded in %s/%d", exc, idx,
                            sweep_dir, idx)
                return sweep_dir / str(idx)

"""Running a job: validate in the parent, train in worker processes started by torch's elastic launcher (or forked
from a warm template), and everything SLURM (`slurm*`; the Hydra plugin in src/hydra_plugins/zerotune_slurm only
calls `slurm_launcher`)."""

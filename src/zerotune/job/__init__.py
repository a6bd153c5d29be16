"""Running a job: validate in the parent, train in worker processes started by torch's elastic launcher.

Everything SLURM: a job process inside a SLURM job (`job`: its geometry, records and requeue), the task srun
starts on each node (`task`), the cluster as scontrol describes it (`cluster`), a sweep's request checked against
it before submission (`request`, `precheck`), and the sweep's launcher's logic (`launcher`: each job followed to
its end, `job_end`). The Hydra plugin in src/hydra_plugins/zerotune_slurm only calls `launcher`."""

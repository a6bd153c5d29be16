"""The command every task of a hydra/launcher=slurm job runs, `python -u -m zerotune.job.slurm_task <folder>`:
submitit's own `_submit` with the stop signals held from the first line, so a pre-emption during the imports is
recorded and requeued (job/slurm.py requeue_if_preempted) instead of ending the task unrecorded and the job FAILED."""

from zerotune.host import process

process.hold()  # before anything else: the imports below are the first seconds of the task


def main() -> None:
    from submitit.core import submission
    from submitit.core.job_environment import JobEnvironment

    install_submitits = JobEnvironment._handle_signals

    def handle_signals(env, paths, delayed) -> None:
        install_submitits(env, paths, delayed)  # its requeue handler, its clock (pre-emption or time-out) from now
        process.hold()  # and set aside: called once the job is recorded, not when the signal comes

    JobEnvironment._handle_signals = handle_signals  # type: ignore[method-assign,assignment]
    submission.submitit_main()


if __name__ == "__main__":
    main()

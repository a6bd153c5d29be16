"""The command every task of a hydra/launcher=slurm job runs: `python -u -m zerotune.job.slurm_task <folder>`,
submitit's own `python -u -m submitit.core._submit <folder>` with the job's stop signals held from its first line.

SLURM signals a job's tasks whenever it pre-empts it, however young the attempt: submitit's own handler comes
only after its imports and the job's unpickling (Hydra, zerotune), seconds in which the signal's default action
would end the task, unrecorded, and the job FAILED instead of requeued. Held (zerotune/host/process.py), the
signal waits for the job process: it does not start its workers, or stops them, records the attempt, and only
then calls submitit's handler, which requeues the job (job/slurm.py requeue_if_preempted).
"""

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

"""Running a job: validate in the parent, train in worker processes started by torch's elastic launcher."""

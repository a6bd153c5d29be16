"""`zerotune tune` (hydra/sweeper=tune): the fastest configuration that fits, for one workload. space.py builds and
screens the candidates, study.py runs the rest as short trials under Optuna's pruner, finalists.py re-measures the
best, outcome.py writes the report and the winner's experiment file; sweep.py runs them in that order. For a card not
present (`--gpu`), the planner's time floor ranks the candidates and none runs."""

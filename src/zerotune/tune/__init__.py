"""`zerotune tune` (hydra/sweeper=tune): the fastest configuration that fits, for one workload.

The command line fixes the workload (model, resolution, global batch) and any knob it names; lists bound a
knob's values. `space` builds the candidates, `screen` drops those the validator refuses or the planner
predicts will not fit, `study` runs the rest as short measured trials under Optuna's successive halving
(train/rungs.py: each trial's job reports samples/s at each rung and may be stopped there), `report` writes
a row per candidate and `winner` the fastest as an experiment file; `sweep` runs them in that order. For a card
not present (`--gpu`), the candidates are ranked by the planner's time floor instead, and none runs."""

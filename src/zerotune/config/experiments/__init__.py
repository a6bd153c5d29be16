"""The packaged experiments: Hydra reads experiment/ (a link to the checkout's experiments/experiment) as
pkg://zerotune.config.experiments, so `zerotune train experiment=<name>` finds them in an installed wheel too."""

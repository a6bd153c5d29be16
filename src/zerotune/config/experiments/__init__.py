"""The packaged experiments, as pkg://zerotune.config.experiments: found in an installed wheel too."""

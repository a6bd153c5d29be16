"""The DeepSpeed config dict: built from the config groups, validated before anything runs."""

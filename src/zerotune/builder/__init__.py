"""The config builder page (`zerotune builder`): compose a configuration from the config groups, see the command
line, the composed config and the validated DeepSpeed JSON as fields change, whether it fits a card, save it as an
experiment, import a DeepSpeed or accelerate file, and open a sweep's results."""

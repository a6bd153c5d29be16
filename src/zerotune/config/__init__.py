"""The config: its types, where it is found, its Hydra composition, the user's own files folded in, the
DeepSpeed blocks config keys map to, the user-facing error, atomic file writes, and the packaged YAML."""

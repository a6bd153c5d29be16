"""The one error type a user sees for bad input: it names the config key and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem found before any model is built."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"`{key}`: {problem}\n  fix: {fix}")


# Exit code for a configuration error (argparse and Hydra use 2 for usage errors too).
CONFIG_ERROR_EXIT = 2

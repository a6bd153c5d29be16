"""The one error type a user sees for bad input: it names the config key and the fix."""

from __future__ import annotations

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration problem found before any model is built."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"`{key}`: {problem}\n  fix: {fix}")


# Exit code for a configuration error (argparse and Hydra use 2 for usage errors too).
CONFIG_ERROR_EXIT = 2


def report_config_error(exc: ConfigError) -> int:
    """How every command tells a config error: one message naming the key and the fix, no traceback; the
    exit status to end with."""
    print(f"zerotune: config error at {exc}", file=sys.stderr)
    return CONFIG_ERROR_EXIT


def exit_config_error(exc: ConfigError) -> NoReturn:
    sys.exit(report_config_error(exc))

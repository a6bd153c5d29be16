"""A config error's fix line, applied: each alternative it offers as overrides (`zero_stage=3, or
offload.params=false`) replaces what the user typed for those keys, and the config must then pass the same
checks. A fix given as a placeholder (`train.batch_size=<int>`) is applied through its example
(`e.g. train.batch_size=64`); a fix that asks for a file edit or another command has no overrides to apply."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from zerotune.config.errors import ConfigError

_ALTERNATIVES = re.compile(r",? or |; or |, else ")
# key=value, where value is a bracketed list or a run of characters that ends the token in prose.
_OVERRIDE = re.compile(r"(?<![\w.\"'/-])([+~]?[A-Za-z_][\w.]*=(?:\[[^\]]*\]|\{[^}]*\}|[^\s,;()]+))")
_COMMAND = re.compile(r"\bpython |\bzerotune (train|plan|ds-config|import-config|export|report|doctor|builder)\b")
_PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|/path/to/")


def alternatives(fix: str) -> list[list[str]]:
    """The fix's alternatives that are overrides to type, each as a list of overrides."""
    found = []
    for part in _ALTERNATIVES.split(_PLACEHOLDER.sub("<>", fix)):  # "<0, 1, 2 or 3>" is one placeholder
        if _COMMAND.search(part):  # a command to run instead (`zerotune plan ... --gpu NAME`)
            continue
        if "e.g. " in part:
            part = part.split("e.g. ", 1)[1]
        overrides = [o.rstrip(".") for o in _OVERRIDE.findall(part)]
        if overrides and not any(_PLACEHOLDER.search(o) for o in overrides):
            found.append(overrides)
    return found


def applied(overrides: list[str], fix: list[str], error_key: str = "") -> list[str]:
    """`overrides` with the fix typed instead of what the user typed for the same keys, and instead of the bad
    value itself when the fix chooses its group (`resolution=1024` replaces `resolution.size=0`)."""
    keys = {_key(o) for o in fix}

    def replaced(override: str) -> bool:
        key = _key(override)
        return key in keys or (key == error_key and any(key.startswith(k + ".") for k in keys))

    return [*(o for o in overrides if not replaced(o)), *fix]


def check_fix(err: ConfigError, overrides: list[str], passes: Callable[[list[str]], object]) -> int:
    """Apply every override alternative of `err`'s fix to `overrides`; `passes` must accept each (it raises the
    ConfigError it finds). The number of alternatives applied."""
    options = alternatives(err.fix)
    for fix in options:
        fixed = applied(overrides, fix, err.key)
        try:
            passes(fixed)
        except ConfigError as again:
            raise AssertionError(f"the fix `{' '.join(fix)}` for `{err.key}` does not work: {' '.join(fixed)} "
                                 f"gives `{again.key}`: {again.problem} (fix: {again.fix})") from None
    return len(options)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def refused_with_fixes(overrides: list[str], run_dir: Path) -> tuple[ConfigError, int]:
    """The ConfigError a job's checks raise for `overrides` as the user typed them, and how many alternatives of
    its fix check_fix applied (each must pass those checks)."""
    from tests.helpers.cli import compose_cfg, preflight

    def passes(typed: list[str]) -> None:
        preflight(compose_cfg(*typed), run_dir=run_dir, overrides=typed)

    try:
        passes(overrides)
    except ConfigError as err:
        return err, check_fix(err, overrides, passes)
    raise AssertionError(f"`{' '.join(overrides)}` was not refused")

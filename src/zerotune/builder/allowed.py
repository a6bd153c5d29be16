"""What the page may write: zerotune's configuration, and nothing Hydra would run. An experiment saved from the
page is run by `zerotune train`, whose Hydra instantiates the `_target_` of every hydra.callbacks entry
(Hydra's blocklist stops os.system, not builtins.open); so an override from the page may not name a
`_target_` anywhere, nor set Hydra's own keys other than the run and sweep folders, which must stay under the
working directory's outputs/ and multirun/ (paths.py), nor a key outside zerotune's schema. Each override
is read by Hydra's own parser; the keys are looked up in the schema itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hydra.core.override_parser.types import ChoiceSweep
from hydra.core.utils import setup_globals
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zerotune import config_search, schema
from zerotune.builder.paths import inside_results, inside_sweep
from zerotune.compose import parse_typed, unknown_key
from zerotune.compose.interpolation import resolvers_in
from zerotune.errors import ConfigError

TARGET = "_target_"
# Hydra's keys the page sets, each with a folder the fix suggests (None: Hydra's default is the one to keep).
FOLDERS = {"hydra.run.dir": "outputs/my_run", "hydra.sweep.dir": "multirun/my_sweep", "hydra.sweep.subdir": None}
YOUR_OWN_FILE = "a config file you write yourself, not in an experiment saved from the page"


def check(lines: Iterable[str]) -> None:
    """Refuse the first override (as typed: `key=value`) the page may not write."""
    for line in lines:
        refused = refusal(line)
        if refused is not None:
            raise refused


def refusal(line: str) -> ConfigError | None:
    """Why the page may not write the override `line`, naming its key and the fix; None where it may."""
    try:
        _check(line)
    except ConfigError as exc:
        return exc
    return None


def _check(line: str) -> None:
    parsed = parse_typed(line)
    key, value = parsed.key_or_group, parsed.value()
    remove = _remove(line)
    if TARGET in key.replace("/", ".").split(".") or _holds_target(value):
        raise ConfigError(key, f"`{TARGET}` names a Python callable, which Hydra calls when it instantiates the "
                          "node; an experiment saved from the page holds configuration only",
                          f"{remove}; callbacks, and anything else Hydra instantiates, belong in {YOUR_OWN_FILE}")
    if parsed.package is not None:  # `data@hydra.callbacks.x=...` would put an option's keys anywhere
        raise ConfigError(key, f"`@{parsed.package}` places the option's keys elsewhere than under its group",
                          f"{remove}, or choose the option at its group: {key}=...")
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        _check_hydra_key(key, value, line)
    elif not schema.describe(key)[0] and key not in config_search.current().group_options():
        raise _unknown(key, line)


def _holds_target(value: Any) -> bool:
    """A `_target_` key in `value`'s maps, at any depth, in lists and sweeps too."""
    if isinstance(value, ChoiceSweep):
        return _holds_target(value.list)
    if isinstance(value, dict):
        return TARGET in value or any(_holds_target(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_target(v) for v in value)
    return False


def _remove(line: str) -> str:
    return f"remove the override `{line}`"


def _check_hydra_key(key: str, value: Any, line: str) -> None:
    if key not in FOLDERS:
        raise ConfigError(key, "Hydra's own settings (callbacks, logging, launcher, sweeper) are not saved from the "
                          f"page; of them it sets only the run and sweep folders: {', '.join(FOLDERS)}",
                          f"{_remove(line)}; Hydra's settings belong on the `zerotune train` command line or in "
                          f"{YOUR_OWN_FILE}")
    example = FOLDERS[key]
    fix = f"{key}={example} (a folder under outputs/ or multirun/), or {_remove(line)}" if example else \
        f"{_remove(line)}: each job's folder is then its number, inside the sweep's folder"
    if not isinstance(value, str):
        raise ConfigError(key, f"`{line}` names no folder", fix)
    folder = _with_time(key, value, fix)
    if key == "hydra.sweep.subdir":
        inside_sweep(folder, key, fix)
    else:
        inside_results(folder, key, fix)


def _with_time(key: str, text: str, fix: str) -> str:
    """The folder `text` names, its `${now:...}` read as Hydra reads it. Any other interpolation is refused:
    another key's value could name any folder, and the folder checked must be the folder written."""
    try:
        if all(name == "now" for name in resolvers_in(text)):
            setup_globals()  # Hydra's `now` resolver, registered as Hydra registers it before a run
            return str(OmegaConf.create({"folder": text}).folder)
    except OmegaConfBaseException:  # another key's value: `${train.seed}`, `${now:${data.path}}`
        pass
    raise ConfigError(key, f"{text!r} interpolates more than ${{now:...}}: a folder here may use the time, as "
                      "Hydra's own folders do, and no other key's value", fix)


def _unknown(key: str, line: str) -> ConfigError:
    """`key` is in no config group nor the schema: its first unknown part is named, with the keys there are."""
    parts = key.split(".")
    first = next(".".join(parts[:n]) for n in range(1, len(parts) + 1) if not schema.describe(".".join(parts[:n]))[0])
    value = line.partition("=")[2] if first == key else "..."
    known = unknown_key(first, "", value or "...").fix
    return ConfigError(key, f"zerotune has no key `{first}`: nothing would read it",
                       f"{_remove(line)}, or set a key zerotune has: {known}")

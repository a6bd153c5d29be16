"""Composing the config as train.py does, every composition error a ConfigError naming the key and the fix (exit 2,
no traceback); and experiment files written from overrides, holding only what differs from the default job."""

from __future__ import annotations

import difflib
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from zerotune.config import schema
from zerotune.config import search as config_search
from zerotune.config.compose.overrides import normalize_overrides, parse_typed
from zerotune.config.errors import ConfigError

if TYPE_CHECKING:
    from zerotune.config.compose.settle import Settled


_PARSER = OverridesParser.create()
# Hydra's compose API keeps one global state per process (GlobalHydra): threads (the builder page's
# requests) compose one at a time.
_HYDRA_STATE = threading.Lock()


@dataclass(frozen=True)
class Composed:
    """A config as Hydra composed it, before the user's files are folded in: what the builder page shows and edits.
    Readers get plain values."""

    node: DictConfig
    choices: dict[str, str]         # the option each config group ended up with

    def values(self, keys: list[str]) -> dict[str, Any]:
        """Each key's value, interpolations resolved (None where the key is unset)."""
        return {key: OmegaConf.select(self.node, key, throw_on_missing=False) for key in keys}

    def tree(self) -> dict[str, Any]:
        """The config as plain data, interpolations as written."""
        return OmegaConf.to_container(self.node, resolve=False)  # type: ignore[return-value]

    def yaml(self) -> str:
        return OmegaConf.to_yaml(self.node)

    def settled(self, typed: list[str]) -> Settled:
        """This config as it will run (config/compose/settle.py); `typed`: the overrides as the user typed them."""
        from zerotune.config.compose.settle import settle

        return settle(self.node, typed)


def compose(overrides: list[str]) -> DictConfig:
    """config.yaml with `overrides` as a user types them (the user's folder searched first: config_search)."""
    return composed(overrides).node


def compose_settled(overrides: list[str], typed: list[str] | None = None, world_size: int | None = None,
                    quiet: bool = False) -> Settled:
    """`overrides` composed as train.py composes them, then settled. `typed`: the overrides the user typed, which
    the user's files may not contradict (all of them by default; the rest come from an experiment or a tool)."""
    from zerotune.config.compose.settle import settle

    return settle(compose(overrides), overrides if typed is None else typed, world_size, quiet=quiet)


def composed(overrides: list[str]) -> Composed:
    """compose(), and the option each config group ended up with (Hydra's runtime choices: an option may
    choose others, as data=digits picks resolution 8)."""
    search = config_search.current()
    args = normalize_overrides(list(overrides), search)
    check_added_keys(args)
    try:
        with _HYDRA_STATE, initialize_config_module(config_search.PACKAGED_CONF, version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=args, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise as_config_error(exc, args) from None
    groups = set(search.group_options()) - {"experiment"}  # a bundle of choices, not one of them
    choices = {g: str(o) for g, o in cfg.hydra.runtime.choices.items() if g in groups}
    with open_dict(cfg):
        del cfg["hydra"]
    check_resolves(cfg, args)
    return Composed(cfg, choices)


@dataclass(frozen=True)
class Setter:
    """The config file whose value of a key the composed config holds."""

    config_path: str                # Hydra's name for it: "config", "data/digits", "experiment/sdxl_4090_1024_bs8"
    file: Path
    chosen: dict[str, str]          # {group: option} a command line or a config's `override` chose


def value_setter(overrides: list[str], key: str) -> Setter | None:
    """Which config gives `key` its value when composed with `overrides` (typed overrides aside): the last file
    in Hydra's defaults list that sets it. None where no file does (the schema's default)."""
    search = config_search.current()
    args = normalize_overrides(list(overrides), search)
    try:
        with _HYDRA_STATE, initialize_config_module(config_search.PACKAGED_CONF, version_base="1.3"):
            found = GlobalHydra.instance().config_loader().compute_defaults_list("config", args, RunMode.RUN)
    except (HydraException, OmegaConfBaseException) as exc:
        raise as_config_error(exc, args) from None
    chosen = dict(found.overrides.override_choices)
    setter = None
    for element in found.defaults:
        path = element.config_path or ""
        file = next((f / f"{path}.yaml" for f in search.folders() if (f / f"{path}.yaml").is_file()), None)
        if file is None or path.startswith("hydra/"):
            continue  # the schema (a structured config), Hydra's own settings
        package = element.package or ""
        if package and not key.startswith(package + "."):
            continue
        relative = key[len(package) + 1:] if package else key
        if OmegaConf.select(OmegaConf.load(file), relative, default=_UNSET) is not _UNSET:
            setter = Setter(path, file, chosen)
    return setter


_UNSET = object()


def check_resolves(cfg: DictConfig, args: list[str]) -> None:
    """Every interpolation resolves, to a value of its key's type: `train.seed=${oc.env:HOME}` is a config
    error naming train.seed, not a traceback from the first code that reads it."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise interpolation_error(exc, args) from None


def interpolation_error(exc: OmegaConfBaseException, args: list[str]) -> ConfigError:
    error = as_config_error(exc, args)
    typed = [a.split("=", 1)[1] for a in args if "=" in a and _key(a) == error.key]
    if not typed or "${" not in typed[0]:
        return error
    missing = _MISSING_ENV.search(str(exc))
    if missing:
        return ConfigError(error.key, f"{typed[0]} does not resolve: the environment has no {missing[1]}",
                           f"set {missing[1]} in the environment, or type the value itself: {error.fix}")
    return ConfigError(error.key, f"{typed[0]} does not resolve: {_reason(exc)}",
                       f"type the value itself: {error.fix}")


_MISSING_ENV = re.compile(r"Environment variable '([^']+)' not found")


def _reason(exc: OmegaConfBaseException) -> str:
    """OmegaConf's first line, less the interpolation it quotes again."""
    line = str(exc).strip().splitlines()[0]
    return line.split("': ", 1)[1] if line.startswith("While dereferencing interpolation") and "': " in line else line


def is_multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in args)


def check_command_line(args: list[str]) -> None:
    """Every job of a sweep composes: each swept value (`-m zero_stage=1,2,3`) tried once, the other sweeps at
    their first value, before the first job starts. A single run is left to Hydra (cli/train.py reports it)."""
    overrides = [a for a in args if "=" in a and not a.startswith("-") and not _key(a).startswith("hydra")]
    check_added_keys(overrides)
    if not is_multirun(args):
        return
    parsed = [parse_typed(o) for o in overrides]
    first = [_with_value(o, next(iter(o.sweep_string_iterator()))) if o.is_sweep_override() else o.input_line
             for o in parsed]
    compose(first)
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in list(o.sweep_string_iterator())[1:]:
                compose([*first[:i], _with_value(o, value), *first[i + 1:]])


def check_added_keys(args: list[str]) -> None:
    """`+key=value` adds a key Hydra does not know; zerotune would then never read it. Config groups
    (`+experiment=...`) and Hydra's own keys may be added."""
    groups = set(config_search.current().group_options())
    for arg in args:
        if "=" not in arg or arg.startswith("-") or _key(arg).startswith("hydra"):
            continue
        o = parse_typed(arg)
        if o.type in (OverrideType.ADD, OverrideType.FORCE_ADD) and o.key_or_group not in groups \
                and not schema.describe(o.key_or_group)[0]:
            raise unknown_key(o.key_or_group, "`+` would add it, and nothing in zerotune reads it",
                              o.get_value_element_as_str() if not o.is_sweep_override() else "...")




# Hydra's words for an experiment file without `# @package _global_`: its keys land under `experiment.`.
_EXPERIMENT_NOT_GLOBAL = re.compile(r"In 'experiment/([^']+)': (ConfigKeyError raised while composing config:\s+"
                                    r"Key 'experiment' not in|Could not override '[^']*@experiment\.)")


def as_config_error(exc: Exception, args: list[str]) -> ConfigError:
    not_global = _EXPERIMENT_NOT_GLOBAL.search(str(exc))
    if not_global:
        name = not_global[1]
        path = config_search.current().option_file("experiment", name) or f"experiment/{name}.yaml"
        return ConfigError("experiment", f"{path} sets its keys under `experiment.` (it has no package line)",
                           f"make `# @package _global_` the first line of {path}")
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    key = getattr(cause, "full_key", None) or ""
    message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    exists, annotation, default = schema.describe(key) if key else (False, None, None)
    if key and not exists:
        typed = [a.split("=", 1)[1] for a in args if "=" in a and _key(a) == key]
        return unknown_key(key, "zerotune has no such key", typed[0] if typed else "...")
    if key:
        example = f", e.g. {key}={default}" if default is not None else ""
        return ConfigError(key, message, f"{key}=<{annotation}>{example}")
    return ConfigError("command line", str(exc).strip().replace("\n", " "), "see `zerotune train --help`")


def unknown_key(key: str, why: str, value: str = "...") -> ConfigError:
    parent, _, leaf = key.rpartition(".")
    known = schema.keys_under(parent)
    close = difflib.get_close_matches(leaf, known, n=1)
    where = f"under {parent}" if parent else "at the top level"
    fix = f"{parent + '.' if parent else ''}{close[0]}={value}" if close else \
        f"one of the keys {where}: {', '.join(known)}"
    return ConfigError(key, f"unknown key ({why})", fix)


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def _with_value(o, value: str) -> str:
    return f"{o.input_line.split('=', 1)[0]}={value}"


# A file name in one folder: no separators, no leading dot or dash, nothing a shell or Hydra must quote.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def experiment_path(name: str, key: str = "name") -> Path:
    """Where experiment `name` is written: the user's experiment/ folder, for a name that cannot leave it. A
    packaged experiment's name is refused: the new file would hide it."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(key, f"{name!r} is not an experiment name: letters, digits, _ and - only (at most "
                          "64, starting with a letter or digit), no path separators or dots",
                          "e.g. my_zero3_cpu")
    search = config_search.current()
    path = search.experiments_folder() / f"{name}.yaml"
    found = search.option_file("experiment", name)
    if found is not None and found != path:
        raise ConfigError(key, f"{name!r} is a packaged experiment ({found}); a file of yours would hide it",
                          f"choose another name, e.g. my_{name}")
    return path


def experiment_file(name: str) -> Path | None:
    """The file `experiment=<name>` reads (the user's, else a packaged one), or None."""
    return config_search.current().option_file("experiment", name) if NAME.fullmatch(str(name)) else None


def experiment_names() -> list[str]:
    return config_search.current().group_options().get("experiment", [])


def write_experiment(path: Path, text: str) -> None:
    """Whole or not at all (a reader never sees half a file), creating the user's folder on first use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def experiment_yaml(overrides: list[str], comments: Sequence[str] = ()) -> str:
    groups = set(config_search.current().group_options()) - {"experiment"}
    choices: list[dict] = []
    values: dict = {}
    for arg in overrides:
        parsed = parse_typed(arg)
        key, value = parsed.key_or_group, parsed.value()
        if key in groups:
            choices.append({f"override /{key}": str(value)})
            continue
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    body = ({"defaults": choices} if choices else {}) | values
    head = ["# @package _global_", *(f"# {line}" for line in comments)]
    return "\n".join(head) + "\n" + (yaml.safe_dump(body, sort_keys=False) if body else "{}\n")

"""The page's form, read from the config groups themselves (a YAML added to a group is a new option), how a filled
form becomes overrides and back, and what the page may write: configuration only. Hydra instantiates an experiment's
`_target_`s (its blocklist stops os.system, not builtins.open), so no override may name one, set Hydra's keys other
than the run and sweep folders (kept under outputs/ and multirun/), or set a key outside zerotune's schema."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from hydra.core.override_parser.types import ChoiceSweep
from hydra.core.utils import setup_globals
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zerotune.builder.access import inside_results, inside_sweep
from zerotune.config import schema, search
from zerotune.config import search as config_search
from zerotune.config.compose import Composed, composed, unknown_key
from zerotune.config.compose.overrides import check_pure_interpolations, override, parse_typed, resolvers_in
from zerotune.config.errors import ConfigError
from zerotune.host.platform import Platform
from zerotune.report.collect import numbers_first

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
    elif not schema.describe(key)[0] and key not in search.current().group_options():
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


# Groups the page leaves out: they name services or output, not what is trained or what it costs.
HIDDEN_GROUPS = ("logger", "experiment")  # experiments are the page's templates, listed on their own
# Keys of a group's options that a user types in, shown beside their group's field.
TYPED_KEYS = {"offload": ("offload.path",), "data": ("data.path",), "optimizer": ("optimizer.lr",),
              "launch": ("launch.num_processes",)}


@dataclass
class Option:
    name: str
    title: str = ""                     # the option file's first comment line
    disabled: str | None = None         # why this platform cannot run it


@dataclass
class Field:
    key: str                            # a group name, or a dotted config key
    kind: str                           # group | int | float | bool | text
    label: str
    options: list[Option] = field(default_factory=list)
    group: str = ""                     # the group a typed key belongs to (its field sits beside it)
    optional: bool = False              # empty means null


@lru_cache(maxsize=1)
def defaults() -> tuple[dict[str, str], dict[str, Any]]:
    """({group: default option}, {knob key: default value}) of the default job, as Hydra composes it; the
    groups in the packaged config.yaml's order, which is the order overrides are written in."""
    found = composed([])
    choices = found.choices
    listed = OmegaConf.to_container(OmegaConf.load(config_search.packaged_conf() / "config.yaml").defaults)
    assert isinstance(listed, list)  # the defaults list
    order = [next(iter(d)) for d in listed if isinstance(d, dict)]
    return {g: choices[g] for g in sorted(choices, key=lambda g: order.index(g) if g in order else len(order))}, \
        knob_values(found)


def as_form(overrides: list[str]) -> dict:
    """The page's form for these overrides (an experiment, an imported file): group choices, field values,
    and the keys without a field as extra overrides."""
    found = composed(overrides)
    return {"choices": found.choices, "values": knob_values(found), "extra": extra_overrides(found)}


def fields(platform: Platform) -> list[Field]:
    groups = [_group_field(g, opts, platform) for g, opts in config_search.current().group_options().items()
              if g not in HIDDEN_GROUPS]
    knobs = [_knob_field(key) for key in _train_keys()]
    shown = {f.key for f in groups}  # a typed key of no shown group (launch.*) stands with the train keys
    typed = [_knob_field(key, group if group in shown else "")
             for group, keys in TYPED_KEYS.items() for key in keys]
    return [*groups, *typed, *knobs]


def knob_keys() -> list[str]:
    return _train_keys() + [k for keys in TYPED_KEYS.values() for k in keys]


def _train_keys() -> list[str]:
    return [f"train.{f.name}" for f in dataclasses.fields(schema.Train)]


def knob_values(found: Composed) -> dict[str, Any]:
    return found.values(knob_keys())


def overrides(choices: dict[str, str], values: dict[str, Any], extra: Sequence[str] = ()) -> list[str]:
    """What differs from the default job, as `zerotune train` takes it: group choices first, then keys, then
    `extra` (overrides the form has no field for, kept as typed). `choices` and `values` hold what the user set,
    each compared with what the rest of the composition gives it. `${oc.env:...}` and the like are refused at their
    key, as is anything `check` refuses."""
    extra = [e.strip() for e in extra if e.strip()]
    typed = [*(override(g, o) for g, o in choices.items()), *(override(k, v) for k, v in values.items()), *extra]
    check(typed)
    check_pure_interpolations(typed)
    groups = group_overrides(choices)
    if not values:
        return groups + extra
    given = composition(tuple(groups))[1]
    return groups + [override(k, v) for k, v in values.items() if k in given and not _same(v, given[k])] + extra


def group_overrides(choices: dict[str, str]) -> list[str]:
    """The fewest `group=option` overrides that compose to `choices`. An option may choose others
    (data=digits picks resolution 8): a choice equal to the default can still be needed, and one that
    differs can be implied by another option. What each option implies is learnt once per option; one
    composition then checks the answer, and where it disagrees every choice is written out."""
    default = defaults()[0]
    order = [g for g in default if g in choices]
    picked = {g: choices[g] for g in order if choices[g] != default[g]}
    emitted = [g for g in order if choices[g] != _implied({h: o for h, o in picked.items() if h != g})[g]]
    if any(composition(tuple(f"{g}={choices[g]}" for g in emitted))[0][g] != choices[g] for g in order):
        emitted = order
    return [f"{g}={choices[g]}" for g in emitted]


def _implied(picked: dict[str, str]) -> dict[str, str]:
    """The choices the default job gets with `picked` chosen, by what each of them implies on its own."""
    out = dict(defaults()[0])
    for group, option in picked.items():
        out |= option_implies(group, option)
    return out


@cache
def option_implies(group: str, option: str) -> dict[str, str]:
    """The other groups' options that choosing `group=option` alone changes from the default job's."""
    chosen, default = composition((f"{group}={option}",))[0], defaults()[0]
    return {g: o for g, o in chosen.items() if g != group and o != default[g]}


@lru_cache(maxsize=512)
def composition(overrides: tuple[str, ...]) -> tuple[dict[str, str], dict[str, Any]]:
    """(group choices, field values) of a composition, cached: the page asks for the same ones again and again."""
    found = composed(list(overrides))
    return found.choices, knob_values(found)


def extra_overrides(found: Composed) -> list[str]:
    """The keys `found` sets beyond its group choices and the form's fields (an experiment's bucket sizes,
    say), as overrides, so that loading and saving an experiment keeps them."""
    plain = composed([f"{g}={o}" for g, o in found.choices.items()])
    ours, theirs = found.tree(), plain.tree()
    skip = set(knob_keys())
    # A key the default job lacks (an experiment's reference.*) is added, as Hydra asks: +key=value.
    return [("+" if theirs is _ABSENT else "") + override(k, v)
            for k, v, theirs in _differences(ours, theirs) if k not in skip]


def _differences(ours: Any, theirs: Any, prefix: str = ""):
    """(dotted key, value, theirs) where `ours` differs; a map `theirs` lacks is one value."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key, value in ours.items():
            yield from _differences(value, theirs.get(key, _ABSENT), f"{prefix}{key}.")
    elif ours != theirs:
        yield prefix[:-1], ours, theirs


_ABSENT = object()


def _same(typed: Any, current: Any) -> bool:
    if typed in ("", None):
        return current is None
    if isinstance(typed, bool) or isinstance(current, bool):
        return str(typed).lower() == str(current).lower()
    if isinstance(current, int | float) and not isinstance(current, bool):
        try:
            return float(typed) == float(current)
        except ValueError:
            return False
    return str(typed) == str(current)


def _group_field(group: str, names: list[str], platform: Platform) -> Field:
    search = config_search.current()
    options = [Option(n, _title(search.option_file(group, n)), _why_not(group, n, platform))
               for n in sorted(names, key=numbers_first)]
    return Field(group, "group", group.replace("_", " "), options)


def _title(path: Path | None) -> str:
    if path is None:  # an option listed, then gone
        return ""
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
    return ""


def _why_not(group: str, option: str, platform: Platform) -> str | None:
    if not platform.deepspeed_supported and ((group == "zero_stage" and option != "0") or
                                             (group == "offload" and option != "none")):
        return f"needs DeepSpeed: {platform.deepspeed_reason}"
    if group == "precision" and option in ("fp32", "bf16", "fp16") and not platform.supports(option):
        return f"this {platform.device_type} device cannot train in {option}"
    return None


def _knob_field(key: str, group: str = "") -> Field:
    # The schema's type for the dotted key (e.g. Optional[str] for offload.path).
    section, _, leaf = key.partition(".")
    annotation = typing.get_type_hints(typing.get_type_hints(schema.Config)[section])[leaf]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = type(None) in typing.get_args(annotation)
    base = args[0] if optional and args else annotation
    kind = {bool: "bool", int: "int", float: "float"}.get(base, "text")
    return Field(key, kind, key.split(".", 1)[1].replace("_", " "), group=group, optional=optional)

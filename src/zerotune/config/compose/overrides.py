r"""Command lines made to work as typed, before Hydra parses them: group choices that look like numbers quoted
(Hydra 1.3 refuses `zero_stage=2` as an int), unknown choices refused with the options; and the resolvers an
override calls, so the builder page's overrides compose without reading the environment (`${oc.env:HOME}`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

from antlr4 import ParserRuleContext
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    Glob,
    Override,
    QuotedString,
    ValueType,
)
from hydra.errors import HydraException
from omegaconf import grammar_parser
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

from zerotune.config import schema
from zerotune.config.compose import settle
from zerotune.config.deepspeed_blocks import is_known, normalize
from zerotune.config.errors import ConfigError
from zerotune.config.search import ConfigSearch

settle.register()  # conf/config.yaml names the schema; every composition goes through this module

_PARSER = OverridesParser.create()
_PLAIN = re.compile(r"^[\w./-]+$")  # a value that needs no quotes
_BEFORE_QUOTE = re.compile(r"(\\*)('|$)")


def strip_local_rank(args: list[str]) -> list[str]:
    """The `deepspeed` launcher appends --local_rank=N, which Hydra refuses; LOCAL_RANK carries it instead."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(args):
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            skip = True
        else:
            out.append(arg)
    return out


def typed_line(override: Override) -> str:
    """The override as it was typed. Hydra's parser sets it on every override it returns; Override declares it
    optional for the overrides built by hand."""
    assert override.input_line is not None
    return override.input_line


def normalize_overrides(args: list[str], search: ConfigSearch) -> list[str]:
    groups = search.group_options()
    return [_normalize_one(arg, groups) for arg in args]


def as_typed(overrides: list[str]) -> list[str]:
    """The overrides without the quotes `normalize_overrides` put around simple values: `zero_stage=2`."""
    out = []
    for line in overrides:
        parsed = _parse(line)
        if parsed is not None and isinstance(parsed._value, QuotedString) and _PLAIN.match(parsed.value()):
            line = f"{line.split('=', 1)[0]}={parsed.value()}"
        out.append(line)
    return out


def override(key: str, value: Any) -> str:
    """`key=value` in Hydra's override grammar, for a Python value (an empty string is null)."""
    return f"{key}={'null' if value == '' else hydra_value(value)}"


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar (not JSON: Hydra's map keys are bare, its strings single-quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text):
        return text
    # Hydra keeps a backslash literal unless quotes or the end follow it: only those runs are doubled.
    return "'" + _BEFORE_QUOTE.sub(lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text) + "'"


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def take_config_dir(args: list[str]) -> tuple[list[str], str | None]:
    """Hydra's `--config-dir DIR` (`-cd DIR`, `--config-dir=DIR`), taken off the command line: Hydra would
    search it after the packaged configs; zerotune searches it first (hydra_plugins/zerotune_user_configs)."""
    out, config_dir, i = [], None, 0
    while i < len(args):
        arg = args[i]
        if arg in CONFIG_DIR_FLAGS:
            if i + 1 >= len(args):
                raise ConfigError("--config-dir", "no folder follows it", "--config-dir ./zerotune")
            config_dir, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    return out, config_dir


def _parse(arg: str):
    """Hydra's own reading of one override, or None for what is not one (flags, Hydra's errors to report)."""
    if arg.startswith("-") or "=" not in arg:
        return None
    try:
        return _PARSER.parse_override(arg)
    except HydraException:  # OverrideParseException, or the HydraException its syntax errors raise
        return None


# `resume=<path>` named a checkpoint before resume had options of its own (resume.strict): it stays the short form.
_SHORT_FORMS = {"resume": "resume.path"}


def _normalize_one(arg: str, groups: dict[str, list[str]]) -> str:
    parsed = _parse(arg)
    if parsed is not None and parsed.key_or_group in _SHORT_FORMS and not parsed.is_delete():
        prefix = arg[: len(arg) - len(arg.lstrip("+"))]
        return f"{prefix}{_SHORT_FORMS[parsed.key_or_group]}{arg[arg.index('='):]}"
    if parsed is None or parsed.key_or_group not in groups or parsed.is_delete():
        return arg
    if parsed.value_type == ValueType.ELEMENT:
        values = [parsed._value]
    elif parsed.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
        values = parsed.value().list
    else:
        return arg  # choice(), range(), glob(): Hydra's own syntax, as written
    texts = [v.text if isinstance(v, QuotedString) else v for v in values]
    if not all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in texts):
        return arg
    key, options = parsed.key_or_group, groups[parsed.key_or_group]
    choices = [_choose(key, str(t), options) for t in texts]
    return f"{arg.split('=', 1)[0]}=" + ",".join(f"'{c}'" for c in choices)


# Groups whose options are all there can be: ZeRO has stages 0-3, DeepSpeed offloads to cpu or nvme, and
# precisions are DeepSpeed's. A YAML of a new name would configure nothing new, so none is suggested.
CLOSED_GROUPS = frozenset({"zero_stage", "offload", "precision", "adapter"})


def _choose(key: str, value: str, options: list[str]) -> str:
    # AdamW, CPUAdam: DeepSpeed's names in any case. A name it does not know may be a user's own option.
    if key == "optimizer" and value not in options and is_known(value):
        value = normalize(value, key="optimizer")
    if value not in options:
        fix = f"choose one of: {', '.join(options)}"
        if key == "resolution":
            fix += f", or {key}.size={value}"
        elif key not in CLOSED_GROUPS:
            fix += f", or add zerotune/{key}/{value}.yaml (in the working directory)"
        raise ConfigError(key, f"no option {value!r} in config group {key!r}", fix)
    return value


# Resolvers that read only the config itself (now: the clock, as Hydra's output folders do). Not oc.decode
# nor oc.create: each parses its string argument as config, so `${oc.decode:'\${oc.env:X}'}` reads X.
PURE_RESOLVERS = frozenset({"oc.select", "oc.dict.keys", "oc.dict.values", "oc.deprecated", "now"})
_OPTIONAL = re.compile(r"^Optional\[(.*)\]$")


def check_pure_interpolations(overrides: Iterable[str], allowed: frozenset[str] = PURE_RESOLVERS) -> None:
    """Refuse the first override (as typed: `key=value`) whose value calls a resolver outside `allowed`."""
    for line in overrides:
        if "${" not in line:
            continue
        parsed = parse_typed(line)
        if parsed.value_type is None:  # a deletion without a value: `~key`
            continue
        check_pure_value(parsed.key_or_group, parsed.value(), allowed=allowed)


def check_pure_value(key: str, value: Any, fix: str | None = None, allowed: frozenset[str] = PURE_RESOLVERS) -> None:
    """Refuse, at `key`, a `value` (a string, or lists, dicts and sweeps of them) that calls a resolver
    outside `allowed`. `fix` defaults to typing the value itself as an override of `key`."""
    for text in strings_in(value):
        _check_text(key, text, allowed, fix or f"type the value itself: {key}={_example(key)}")


def strings_in(value: Any) -> Iterator[str]:
    """Every string in an override's value: in lists and dicts (keys too) and in sweeps (`a,b`, choice(),
    glob()); numbers and range()/interval() sweeps hold none."""
    if isinstance(value, QuotedString):
        yield value.text
    elif isinstance(value, str):
        yield value
    elif isinstance(value, ChoiceSweep):
        yield from strings_in(value.list)
    elif isinstance(value, Glob):
        yield from strings_in([*value.include, *value.exclude])
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings_in(key)
            yield from strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings_in(item)


def resolvers_in(text: str) -> list[str]:
    """The resolvers `text` calls, nested ones included (`${oc.select:${oc.env:X}}`: oc.select, oc.env).
    A resolver whose name is itself an interpolation is named by its text (`${x}:...`): it is never allowed."""
    if "${" not in text:
        return []
    return [_resolver_name(node) for node in _descendants(grammar_parser.parse(text))
            if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext)]


def _check_text(key: str, text: str, allowed: frozenset[str], fix: str) -> None:
    try:
        names = resolvers_in(text)
    except GrammarParseError as exc:
        raise ConfigError(key, f"OmegaConf cannot read the interpolation in {text!r}: {exc}",
                          f"{fix} (\\${{ stands for the characters ${{)") from None
    refused = [name for name in names if name not in allowed]
    if refused:
        raise ConfigError(key, f"{text!r} calls the resolver `{refused[0]}`; here a value may only refer to other "
                          f"config keys (${{train.batch_size}}) or call {', '.join(sorted(allowed))}: nothing that "
                          "reads the environment, files or other input", fix)


def _resolver_name(node: OmegaConfGrammarParser.InterpolationResolverContext) -> str:
    name = node.getChild(1)  # INTER_OPEN resolverName COLON sequence? BRACE_CLOSE
    return name.getText()


def _descendants(node: ParserRuleContext) -> Iterator[Any]:
    for child in node.getChildren():
        yield child
        if isinstance(child, ParserRuleContext):
            yield from _descendants(child)


def _example(key: str) -> str:
    """A value to type for `key`: its default, else its type (`<str>` for an Optional[str] key)."""
    exists, annotation, default = schema.describe(key)
    if exists and default is not None and not isinstance(default, dict | list):
        return str(default).lower() if isinstance(default, bool) else str(default)
    if not exists or annotation is None:  # None: a key inside a dict-typed field (model.unet.*), of any type
        return "<value>"
    return f"<{_OPTIONAL.sub(lambda m: m[1], annotation or 'value')}>"


def parse_typed(arg: str):
    """Hydra's reading of one override as typed; what Hydra cannot read is a config error naming its key."""
    try:
        return _PARSER.parse_override(arg)
    except HydraException as exc:
        key, _, value = arg.partition("=")
        raise ConfigError(key.lstrip("+~"), f"Hydra cannot read `{arg}`: {exc}",
                          f"quote the value ({key}='{value}') or fix its brackets") from None

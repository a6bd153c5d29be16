"""Which OmegaConf resolvers an override's value calls, read with OmegaConf's own grammar, so that overrides
from a less trusted source (the builder page) compose without reading the environment: `${a.b}` (another
config key) and the pure resolvers are accepted, `${oc.env:HOME}` and any other resolver are refused with
a ConfigError at the override's key. Escaped `\\${` is text, not an interpolation."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from antlr4 import ParserRuleContext
from hydra.core.override_parser.types import ChoiceSweep, Glob, QuotedString
from omegaconf import grammar_parser
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

from zerotune import schema
from zerotune.compose import parse_typed
from zerotune.errors import ConfigError

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

"""Under pytest-xdist (`make test` runs one worker per core with `--dist loadgroup`), tests that share a set-up
wider than one test (a session or module fixture: a trained run, a SLURM cluster, a browser, a dry run) must run
on one worker, or each worker would pay for that set-up again. This marks every test with the group of the
set-ups it shares, joined through the tests that share several (union-find), so each shared set-up runs once.
xdist hands out the largest groups first; tests that share nothing are handed out one by one between them."""

from __future__ import annotations

import inspect
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SHARED_SCOPES = ("session", "package", "module", "class")


def grouping(config: pytest.Config) -> bool:
    """Whether this process collects for `--dist loadgroup`. In a worker xdist rewrites `dist` to "no" and keeps
    the choice as `loadgroup` (xdist/remote.py setup_config): the workers are the ones that collect."""
    return config.getoption("dist", "no") == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def threads_per_worker() -> int | None:
    """Torch threads for each worker (and the jobs it starts), so that the workers together use each core once:
    two workers' spinning intra-op threads on the same cores slow both several times over. None outside xdist."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


def shared_setups(item: pytest.Item, tests_dir: Path) -> list[str]:
    """The set-ups wider than one test that `item` uses: this suite's fixtures of a wider scope, each named by
    what one instance of it serves (a session fixture: the session; a module fixture: the item's module)."""
    keys = []
    # _fixtureinfo is pytest's only record of which definition serves each of an item's fixtures; pytest-xdist
    # and pytest-randomly read it too.
    for name, defs in item._fixtureinfo.name2fixturedefs.items():  # type: ignore[attr-defined]
        fixturedef = defs[-1]
        if fixturedef.scope not in SHARED_SCOPES or not _defined_in(fixturedef.func, tests_dir):
            continue
        if fixturedef.scope in ("session", "package"):
            keys.append(name)
        elif fixturedef.scope == "module":
            keys.append(f"{item.path.name}::{name}")
        else:
            keys.append(f"{item.parent.nodeid if item.parent else item.nodeid}::{name}")
    return keys


def _defined_in(func: object, tests_dir: Path) -> bool:
    try:
        return Path(inspect.getfile(func)).resolve().is_relative_to(tests_dir)  # type: ignore[arg-type]
    except TypeError:  # a builtin: not this suite's
        return False


def mark_groups(items: list[pytest.Item], tests_dir: Path) -> None:
    """Add an `xdist_group` marker to every item that shares a set-up, one group per connected set of set-ups.
    The group's name is the smallest key in it, so every worker names it alike (xdist checks that workers
    collected the same node ids, which carry the group)."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    tests_dir = tests_dir.resolve()  # once: every fixture's file is compared with it
    per_item = [(item, shared_setups(item, tests_dir)) for item in items]
    for _, keys in per_item:
        for key in keys:
            parent.setdefault(key, key)
        for other in keys[1:]:
            a, b = find(keys[0]), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    for item, keys in per_item:
        if keys:
            item.add_marker(pytest.mark.xdist_group(find(keys[0])))


DURATIONS = "durations.json"  # {node id: seconds} of the tests that share nothing, from a cold `make test`


def longest_first(items: list[pytest.Item], durations: dict[str, float]) -> None:
    """Order the tests that share nothing longest first (their recorded seconds; unknown ones last), in place.
    xdist hands out groups before them and single tests in collection order: a long test handed out last keeps
    one worker busy while the other idles (the longest-processing-time-first rule). Grouped tests keep their
    order, so a module's shared set-up still runs once."""
    def key(item: pytest.Item) -> float:
        return 0.0 if item.get_closest_marker("xdist_group") else -durations.get(item.nodeid, 0.0)

    items.sort(key=key)  # stable: grouped tests (all 0) keep their relative order


def read_durations(tests_dir: Path) -> dict[str, float]:
    found = tests_dir / DURATIONS
    return json.loads(found.read_text()) if found.is_file() else {}


def durations_from_junit(junit: Path, minimum_s: float = 1.0) -> dict[str, float]:
    """{node id: seconds} of a junit file's ungrouped tests of at least `minimum_s` (a grouped test's class name
    carries its group after an @: xdist schedules groups by size, so their times are not needed)."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        module, name, seconds = case.get("classname", ""), case.get("name", ""), float(case.get("time", 0))
        if "@" in module or "@" in name or seconds < minimum_s:
            continue
        out[module.replace(".", "/") + ".py::" + name] = round(seconds, 1)
    return dict(sorted(out.items()))


if __name__ == "__main__":  # python -m tests.helpers.xdist_groups <junit.xml>: rewrite tests/durations.json
    import sys

    table = durations_from_junit(Path(sys.argv[1]))
    (Path(__file__).parents[1] / DURATIONS).write_text(json.dumps(table, indent=0) + "\n")
    print(f"{len(table)} tests, {sum(table.values()):.0f} s")

"""How long is the way through the code from a job's entry to its training step?

The walk follows the config from `zerotune.job.parent.run_job` (or, with `--from cli`, from the command's entry
`zerotune.cli.train.main`) through every call of zerotune's own code that passes it on, or an object made from it:

- a stop is such a call (a function of `zerotune` or `hydra_plugins.zerotune*`, one of whose arguments, `self`
  included, is the config or was made from it, or holds such an object one level down);
- a room is a module: the distinct modules among the stops;
- a return is a re-entry into a module the walk had left before (A B A: one return);
- a climb is a stop whose caller's module sits in a lower layer than its own, by the layers contract of
  `[tool.importlinter]` in pyproject.toml (a caller outside the layers, Hydra's or torch's, never climbs);
  since that contract forbids imports upward, only a callback or a thread can climb. A rise, counted beside
  it, is a step of the walk's order from a lower layer's module to a higher one's, whoever calls.

A call made again from the same line (a loop, a recursion, a helper reached twice) is read once, at its first
time; `--every-call` counts each.

It runs one short default job (`python train.py train.max_steps=1 evaluate.enabled=false checkpoint.final=false`:
the keys it changes act after the first step) under a `sys.setprofile` tracer, in the job's process and in its
worker: a `sitecustomize` on the job's PYTHONPATH, which the worker inherits, wraps the entry functions so the
tracer starts where they are called. What a stop returns, and the object an `__init__` stop builds, is made from
the config; so are the fields and attributes of such objects (two levels down, when a stop returns).

The walk printed is the parent's stops until the worker reached its step, then the worker's, from
`zerotune.job.worker.main` (its config is the run directory the parent wrote) to the first call of the
training step (`zerotune.train.trainer:Trainer.train_step`). The stops of the parent's other threads (its
checks) are read where the thread was started. The figures are also given split by thread: the main threads'
way (run_job, the launch, the worker to its step) and the branch the parent's checks take beside it.

    python benchmarks/walk.py [--list] [--json PATH] [--from job|cli] [overrides ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHORT_JOB = ("train.max_steps=1", "evaluate.enabled=false", "checkpoint.final=false")
STEP = "zerotune.train.trainer:Trainer.train_step"

# Where each walk starts: the function the tracer wraps, and the parameters of functions whose arguments are the
# config (the roots). Under `--from cli` the config is first the command line (sys.argv), then what Hydra
# composed from it and hands to the task function.
ENTRIES: dict[str, tuple[str, str]] = {
    "job": ("zerotune.job.parent", "run_job"),
    "cli": ("zerotune.cli.train", "main"),
    "worker": ("zerotune.job.worker", "main"),
}
ROOTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("zerotune.job.parent", "run_job"): ("cfg", "spec"),
    ("zerotune.cli.train", "_hydra_main"): ("cfg",),
    ("zerotune.job.worker", "main"): ("run_dir",),
}
OWN = ("zerotune.", "hydra_plugins.zerotune")
# Frames between a call and its caller that nobody reads as a step of the way: a `with` statement's
# contextlib, and this tracer's own wrapper around the entry functions.
PASS_THROUGH = ("contextlib", "zerotune_walk_tracer")
# Dunder methods a reader steps into as a call; any other (__eq__, __iter__, __getattr__, ...) is run by
# Python's machinery, not passed the config by a line of code: it carries taint on but is no stop.
READ_DUNDERS = frozenset({"__init__", "__post_init__", "__enter__", "__exit__", "__call__"})
GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
CHILDREN_CAP = 48  # attributes or elements looked at per object: enough for config blocks, cheap for big lists
ENV_DIR, ENV_ENTRY, ENV_STEP = "ZEROTUNE_WALK_DIR", "ZEROTUNE_WALK_ENTRY", "ZEROTUNE_WALK_STEP"


# ---------------------------------------------------------------------------------------------------- figures

def module_runs(modules: Sequence[str]) -> list[str]:
    """The rooms in the order the walk is in them: consecutive stops in one module are one visit."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def count_rooms(modules: Sequence[str]) -> int:
    return len(set(modules))


def count_returns(modules: Sequence[str]) -> int:
    """Re-entries into a module left before: [a, b, a, c, b] -> 2."""
    seen: set[str] = set()
    returns = 0
    for module in module_runs(modules):
        returns += module in seen
        seen.add(module)
    return returns


def returns_by_module(modules: Sequence[str]) -> Counter[str]:
    seen: set[str] = set()
    counts: Counter[str] = Counter()
    for module in module_runs(modules):
        if module in seen:
            counts[module] += 1
        seen.add(module)
    return counts


def read_layers(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, int]:
    """Each top-level name under `zerotune` to its layer's index in the layers contract (0: the top)."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c.get("type") == "layers" and c.get("containers") == ["zerotune"])
    return {name.strip(): index for index, layer in enumerate(layers["layers"]) for name in layer.split("|")}


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """`zerotune.plan.guard` -> the layer holding `plan`; None outside the contract (Hydra, torch, __main__)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "zerotune":
        return None
    return layers.get(parts[1])


def is_climb(caller: str, callee: str, layers: dict[str, int]) -> bool:
    """A call up the layers: the caller's layer is below (a larger index than) the callee's."""
    low, high = layer_of(caller, layers), layer_of(callee, layers)
    return low is not None and high is not None and low > high


def count_rises(modules: Sequence[str], layers: dict[str, int]) -> int:
    """Steps of the walk's order from a module in a lower layer to one in a higher layer (the walk going back
    up once a lower room is done), whoever calls: what a reader climbs, where `climbs` counts the calls up."""
    levels = [layer_of(m, layers) for m in module_runs(modules)]
    return sum(a is not None and b is not None and a > b for a, b in zip(levels, levels[1:], strict=False))


def read_once(stops: Sequence[dict]) -> list[dict]:
    """A call made again from the same line (a loop, a recursion, a helper's helper reached twice) is read
    once: the stops at its first time."""
    seen: set[tuple] = set()
    kept = []
    for s in stops:
        key = (s["caller"], s["caller_function"], s["caller_line"], s["module"], s["function"])
        if key not in seen:
            seen.add(key)
            kept.append(s)
    return kept


def figures(stops: Sequence[dict], layers: dict[str, int]) -> dict[str, int]:
    modules = [s["module"] for s in stops]
    return {"stops": len(stops), "rooms": count_rooms(modules), "returns": count_returns(modules),
            "climbs": sum(is_climb(s["caller"], s["module"], layers) for s in stops),
            "rises": count_rises(modules, layers)}


# ----------------------------------------------------------------------------------------------------- tracer

def _scalar(value: Any) -> bool:
    """Values whose identity says nothing about where they came from: small ints, interned names, singletons,
    and code rather than data. Tainting one would make every later call passing an equal value a stop."""
    if value is None or isinstance(value, (bool, int, float, complex, bytes, enum.Enum, type, types.ModuleType,
                                           types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return True
    if isinstance(value, str):
        return len(value) < 2 or sys.intern(value[:1] + value[1:]) is value  # the interned copy, shared by id
    return isinstance(value, (tuple, frozenset)) and not value  # () and frozenset() are singletons


def _data(value: Any) -> bool:
    """An object's attributes that are made from what made the object: its paths, records, configs and
    collections. Not its strings: a random token, a name of its own."""
    omegaconf = sys.modules.get("omegaconf")
    return (isinstance(value, (os.PathLike, list, tuple, dict, set, frozenset))
            or (dataclasses.is_dataclass(value) and not isinstance(value, type))
            or (omegaconf is not None and isinstance(value, omegaconf.Container)))


def _children(value: Any) -> Iterator[Any]:
    """The objects one level inside `value`: a DictConfig's sub-configs, a dataclass's fields, a container's
    elements, and an object's attributes that are data (_data). An object's other attributes (a sampler, a
    thread, a lock it was handed) were not made from what made it."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(value, omegaconf.Container):
        content = value.__dict__.get("_content")
        items = content.values() if isinstance(content, dict) else content if isinstance(content, list) else ()
        yield from (c for c in list(items)[:CHILDREN_CAP] if isinstance(c, omegaconf.Container))
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        yield from list(value)[:CHILDREN_CAP]
    elif isinstance(value, dict):
        yield from list(value.values())[:CHILDREN_CAP]
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value)[:CHILDREN_CAP]:
            yield getattr(value, f.name, None)
    else:
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict) and not isinstance(value, type):
            yield from (a for a in list(attributes.values())[:CHILDREN_CAP] if _data(a))


class Tracer:
    """The stops of one process, from its entry function's call on (every thread started after that too)."""

    def __init__(self, role: str, step: str, out_dir: Path, argv_root: bool = False) -> None:
        self.role, self.out_dir = role, out_dir
        self.step = tuple(step.split(":", 1))
        self.tainted: dict[int, Any] = {}   # by id; the objects are held so that no id is reused meanwhile
        self.stops: list[dict] = []
        self.calls: dict[int, tuple[Any, Any]] = {}  # a frame whose return is made from the config -> (frame, self)
        self.generators: dict[int, Any] = {}  # generator frames already entered: a resumption is no call
        self.step_at: float | None = None
        self.done = False
        # thread name -> (the thread that started it, how many of that thread's stops came before): where its
        # stops are read (in_reading_order)
        self.started: dict[str, tuple[str, int]] = {}
        if argv_root:
            self.taint(sys.argv)

    # -- taint
    def taint(self, value: Any, depth: int = 2) -> None:
        """`value` and what it holds, `depth` levels down, are made from the config."""
        if _scalar(value):
            return
        self.tainted[id(value)] = value
        if depth > 0:
            for child in _children(value):
                self.taint(child, depth - 1)

    def holds_taint(self, value: Any) -> bool:
        """`value` is made from the config, or holds such an object one level down."""
        if id(value) in self.tainted:
            return True
        if isinstance(value, str) or _scalar(value):
            return False
        return any(id(child) in self.tainted for child in _children(value))

    # -- profile
    def start(self) -> None:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def stop_tracing(self) -> None:
        self.done = True
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None removes it, as sys.setprofile(None) does

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith(OWN):
                self.on_call(frame, module)
            elif module == "threading" and frame.f_code.co_name == "start":
                self.on_thread_start(frame.f_locals.get("self"))
        elif event == "return" and id(frame) in self.calls:
            self.on_return(frame, arg)

    def on_call(self, frame: types.FrameType, module: str) -> None:
        code = frame.f_code
        if code.co_flags & GENERATOR_FLAGS:
            if id(frame) in self.generators:
                return  # a generator resumed (a `next`, a `with` block's end): not a new call
            self.generators[id(frame)] = frame
        if code.co_name.startswith("<"):
            return  # lambdas and comprehensions: the lines of the function around them
        names = _argument_names(code)
        values = frame.f_locals
        for param in ROOTS.get((module, code.co_qualname), ()):
            self.taint(values.get(param))
        if not any(self.holds_taint(values.get(name)) for name in names):
            return
        owner = values.get("self") if names and names[0] == "self" else None
        if code.co_name == "__init__" and owner is not None:
            self.taint(owner, depth=0)  # the object being built is made from the config
        # A dataclass's generated __init__ (dataclasses.replace's too) and the dunders Python calls on its own
        # carry the config on (what they return is made from it) but have no lines a reader follows: no stop.
        generated = code.co_filename.startswith("<")
        if generated or (code.co_name.startswith("__") and code.co_name not in READ_DUNDERS):
            self.calls[id(frame)] = (frame, None)
            return
        self.calls[id(frame)] = (frame, owner)  # its attributes are looked at again when it returns
        caller = _caller(frame)
        self.stops.append({
            "module": module, "function": code.co_qualname, "line": code.co_firstlineno,
            "caller": caller.f_globals.get("__name__", "") if caller else "",
            "caller_function": caller.f_code.co_qualname if caller else "",
            "caller_line": caller.f_lineno if caller else 0,
            "thread": threading.current_thread().name, "t": time.time(),
        })
        if (module, code.co_qualname) == self.step:
            self.step_at = self.stops[-1]["t"]
            self.stop_tracing()
            self.write()

    def on_thread_start(self, thread: Any) -> None:
        if isinstance(thread, threading.Thread):
            starter = threading.current_thread().name
            self.started[thread.name] = (starter, sum(s["thread"] == starter for s in self.stops))

    def on_return(self, frame: types.FrameType, value: Any) -> None:
        _, owner = self.calls[id(frame)] if frame.f_code.co_flags & GENERATOR_FLAGS else self.calls.pop(id(frame))
        self.taint(value)  # what a stop returns (or a generator yields) is made from what it was given
        if owner is not None and id(owner) in self.tainted:
            self.taint(owner)  # attributes a method (an __init__ above all) set on it

    def write(self) -> None:
        rank = os.environ.get("RANK", "0")
        name = f"{self.role}.json" if self.role != "worker" else f"worker-rank{rank}.json"
        record = {"role": self.role, "pid": os.getpid(), "step_at": self.step_at, "stops": self.stops,
                  "started": self.started}
        (self.out_dir / name).write_text(json.dumps(record))


def _argument_names(code: types.CodeType) -> tuple[str, ...]:
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    return code.co_varnames[:count]


def _caller(frame: types.FrameType) -> types.FrameType | None:
    caller = frame.f_back
    while caller is not None and caller.f_globals.get("__name__", "").startswith(PASS_THROUGH):
        caller = caller.f_back
    return caller


def _traced(fn: Callable, role: str) -> Callable:
    """`fn` run under a tracer: the entry of a walk (run_job, the command's main, the worker's main)."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        tracer = Tracer(role, os.environ.get(ENV_STEP, STEP), Path(os.environ[ENV_DIR]), argv_root=role == "cli")
        tracer.start()
        try:
            return fn(*args, **kwargs)
        finally:
            if not tracer.done:
                tracer.stop_tracing()
                tracer.write()

    return entry


class _EntryFinder(importlib.abc.MetaPathFinder):
    """Wraps an entry function as its module is imported, so that the tracer (and its cost) starts there and
    the product's code is run unchanged."""

    def __init__(self, entries: dict[str, tuple[str, str]]) -> None:
        self.entries = entries  # module -> (function, role)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.entries:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return None
        function, role = self.entries[fullname]
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: types.ModuleType) -> None:
            exec_module(module)
            setattr(module, function, _traced(getattr(module, function), role))

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]  # this spec's own loader
        return spec


def install() -> None:
    """Called by the sitecustomize of a traced job: wrap the parent's entry and the worker's."""
    if not os.environ.get(ENV_DIR):
        return
    entry = os.environ.get(ENV_ENTRY, "job")
    wanted = {ENTRIES[entry][0]: (ENTRIES[entry][1], entry), ENTRIES["worker"][0]: (ENTRIES["worker"][1], "worker")}
    sys.meta_path.insert(0, _EntryFinder(wanted))


# ----------------------------------------------------------------------------------------------------- driver

SITECUSTOMIZE = """\
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("zerotune_walk_tracer", {path!r})
_walk = importlib.util.module_from_spec(_spec)
sys.modules["zerotune_walk_tracer"] = _walk
_spec.loader.exec_module(_walk)
_walk.install()
"""


@dataclasses.dataclass
class Walk:
    parent: list[dict]        # the job's process, until the worker reached its step
    worker: list[dict]        # rank 0, from its entry to the step
    parent_after: int         # the parent's calls after that (recording the job): not part of the walk
    reached_step: bool
    seconds: float            # the traced job, start to end
    calls: int = 0            # the calls traced before read_once

    def read_once(self) -> Walk:
        return dataclasses.replace(self, parent=read_once(self.parent), worker=read_once(self.worker),
                                   calls=len(self.stops))

    @property
    def stops(self) -> list[dict]:
        return self.parent + self.worker


def in_reading_order(stops: Sequence[dict], started: dict[str, tuple[str, int]]) -> list[dict]:
    """A thread's stops are read as one block where it was started (after its starter's stops up to then), as
    a reader follows `Thread(target=...).start()`; a thread started before the walk began comes at the end."""
    by_thread: dict[str, list[dict]] = {}
    for s in stops:
        by_thread.setdefault(s["thread"], []).append(s)

    def read(thread: str) -> list[dict]:
        own = by_thread.get(thread, [])
        children = sorted((count, name) for name, (starter, count) in started.items()
                          if starter == thread and name != thread and name in by_thread)
        ordered, done = [], 0
        for count, name in children:
            ordered += own[done:count] + read(name)
            done = max(done, count)
        return ordered + own[done:]

    ordered = read("MainThread")
    placed = {id(s) for s in ordered}
    return ordered + [s for s in stops if id(s) not in placed]


def trace_job(overrides: Sequence[str], entry: str = "job", step: str = STEP, timeout_s: float = 900) -> Walk:
    """Run `python train.py SHORT_JOB overrides` under the tracer and read back the walk."""
    with tempfile.TemporaryDirectory(prefix="zerotune-walk-") as tmp:
        shim, out = Path(tmp, "shim"), Path(tmp, "stops")
        shim.mkdir()
        out.mkdir()
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=str(Path(__file__).resolve())))
        path = [str(shim), str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), ENV_DIR: str(out), ENV_ENTRY: entry,
               ENV_STEP: step, "PYTHONUNBUFFERED": "1"}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a job of its own, not a rank of a caller's
            env.pop(name, None)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *SHORT_JOB, *overrides,
                               f"hydra.run.dir={Path(tmp, 'run')}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        seconds = time.monotonic() - started
        parent_file, worker_file = out / f"{entry}.json", out / "worker-rank0.json"
        if proc.returncode != 0 or not parent_file.exists():
            raise RuntimeError(f"the traced job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        parent = json.loads(parent_file.read_text())
        worker = json.loads(worker_file.read_text()) if worker_file.exists() else {"stops": [], "step_at": None,
                                                                                    "started": {}}
    step_at = worker["step_at"]
    before = [s for s in parent["stops"] if step_at is None or s["t"] <= step_at]
    walk = Walk(parent=in_reading_order(before, parent["started"]),
                worker=in_reading_order(worker["stops"], worker["started"]),
                parent_after=len(parent["stops"]) - len(before), reached_step=step_at is not None, seconds=seconds)
    walk.calls = len(walk.stops)
    return walk


# ----------------------------------------------------------------------------------------------------- output

def listing(walk: Walk, layers: dict[str, int]) -> list[str]:
    """The numbered stops: `>` a room entered for the first time, `<` a return, `^` a climb (caller named)."""
    lines, seen, previous = [], set(), None
    for number, s in enumerate(walk.stops, 1):
        if number == 1:
            lines.append("-- the job's process (parent) --")
        if number == len(walk.parent) + 1:
            lines.append("-- the worker (rank 0) --")
        module = s["module"]
        mark = " " if module == previous else "<" if module in seen else ">"
        seen.add(module)
        previous = module
        thread = "" if s["thread"] == "MainThread" else f"  [{s['thread']}]"
        climb = f"  ^ climb from {s['caller']}:{s['caller_function']}" if is_climb(s["caller"], module, layers) else ""
        lines.append(f"{number:4} {mark} {module}:{s['function']} ({s['line']}){thread}{climb}")
    return lines


def report(walk: Walk, layers: dict[str, int], top: int = 8) -> dict[str, Any]:
    modules = [s["module"] for s in walk.stops]
    return {
        "parent": figures(walk.parent, layers), "worker": figures(walk.worker, layers),
        "total": figures(walk.stops, layers), "reached_step": walk.reached_step,
        # The same stops split by thread: the main threads' way (run_job, the launch, the worker to its step)
        # and the branch the parent's other threads take beside it (the checks: resolution and the memory plan).
        "main_threads": figures([s for s in walk.stops if s["thread"] == "MainThread"], layers),
        "other_threads": figures([s for s in walk.stops if s["thread"] != "MainThread"], layers),
        "calls_traced": walk.calls, "parent_calls_after_step": walk.parent_after, "seconds": round(walk.seconds, 1),
        "stops_by_module": dict(Counter(modules).most_common(top)),
        "returns_by_module": dict(returns_by_module(modules).most_common(top)),
        "climbs": [f"{s['caller']}:{s['caller_function']} -> {s['module']}:{s['function']}"
                   for s in walk.stops if is_climb(s["caller"], s["module"], layers)],
        "rises": [f"{a['module']}:{a['function']} -> {b['module']}:{b['function']}"
                  for a, b in zip(walk.stops, walk.stops[1:], strict=False) if is_climb(a["module"], b["module"], layers)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"The job: python train.py {' '.join(SHORT_JOB)} [overrides]")
    parser.add_argument("overrides", nargs="*", help="more of the job's overrides (key=value)")
    parser.add_argument("--from", dest="entry", choices=("job", "cli"), default="job",
                        help="start at run_job (default) or at the command's entry, cli/train.py's main")
    parser.add_argument("--step", default=STEP, help=f"the training step's function, module:qualname ({STEP})")
    parser.add_argument("--every-call", action="store_true",
                        help="count every call; by default a call made again from the same line is read once")
    parser.add_argument("--list", action="store_true", help="print the numbered stops")
    parser.add_argument("--json", type=Path, help="write the figures (and the stops) to this file")
    args = parser.parse_args(argv)

    layers = read_layers()
    walk = trace_job(args.overrides, args.entry, args.step)
    if not args.every_call:
        walk = walk.read_once()
    figures_ = report(walk, layers)
    if args.list:
        print("\n".join(listing(walk, layers)))
        print()
    start = ENTRIES[args.entry]
    print(f"walk from {start[0]}:{start[1]} to {args.step} (the parent until the worker's step, then the worker)")
    for part in ("parent", "worker", "total", "main_threads", "other_threads"):
        f = figures_[part]
        print(f"  {part:13} {f['stops']:4} stops {f['rooms']:3} rooms {f['returns']:3} returns {f['climbs']:3} climbs"
              f"  ({f['rises']} rises: steps of the walk up the layers)")
    if not walk.reached_step:
        print("  the worker never reached the step")
    once = "" if args.every_call else f"; each call site read once ({walk.calls} calls traced)"
    print(f"  traced job: {walk.seconds:.1f} s{once}; the parent's calls after the step, not counted: "
          f"{walk.parent_after}")
    print("most stops:   " + ", ".join(f"{m} {n}" for m, n in figures_["stops_by_module"].items()))
    print("most returns: " + ", ".join(f"{m} {n}" for m, n in figures_["returns_by_module"].items()))
    print(f"climbs ({len(figures_['climbs'])}):")
    print("\n".join(f"  {c}" for c in figures_["climbs"]))
    if args.json:
        args.json.write_text(json.dumps({**figures_, "stops": walk.stops}, indent=1))
    return 0 if walk.reached_step else 1


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/walk.py: the walk from a job's entry to its training step, and how its figures are counted."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks import walk


def stop(module: str, caller: str = "", thread: str = "MainThread", line: int = 1, function: str = "f") -> dict:
    return {"module": module, "function": function, "line": 1, "caller": caller, "caller_function": "g",
            "caller_line": line, "thread": thread, "t": 0.0}


def test_rooms_and_returns_of_a_sequence():
    assert walk.count_rooms(list("abacb")) == 3
    assert walk.count_returns(list("abacb")) == 2
    assert walk.count_returns(list("aabba")) == 1  # staying in a room is no return
    assert walk.count_returns(list("abc")) == 0
    assert walk.module_runs(list("aabba")) == ["a", "b", "a"]
    assert walk.returns_by_module(list("abacbab")) == {"a": 2, "b": 2}


def test_layers_come_from_the_import_contract():
    layers = walk.read_layers()
    assert layers["cli"] == 0
    assert layers["builder"] == layers["tune"]  # `builder | tune`: one layer
    assert layers["job"] < layers["train"] < layers["plan"] < layers["config"]
    assert walk.layer_of("zerotune.plan.guard", layers) == layers["plan"]
    assert walk.layer_of("zerotune.cli.command", layers) == 0
    assert walk.layer_of("hydra.main", layers) is None
    assert walk.layer_of("zerotune.host.process", layers) == layers["models"] == 6


def test_a_climb_is_a_call_from_a_lower_layer_to_a_higher_one():
    layers = walk.read_layers()
    assert walk.is_climb("zerotune.host.ops", "zerotune.job.parent", layers)  # a callback up
    assert not walk.is_climb("zerotune.job.parent", "zerotune.config.compose.settle", layers)  # down
    assert not walk.is_climb("zerotune.train.run", "zerotune.plan.guard", layers)  # down
    assert not walk.is_climb("threading", "zerotune.job.parent", layers)  # a caller outside the layers
    stops = [stop("zerotune.job.parent", "zerotune.cli.train"), stop("zerotune.config.compose.settle", "zerotune.job.parent"),
             stop("zerotune.job.elastic", "zerotune.host.ops"),
             stop("zerotune.config.compose.settle", "zerotune.job.parent")]
    assert walk.figures(stops, layers) == {"stops": 4, "rooms": 3, "returns": 1, "climbs": 1, "rises": 1}


def test_a_call_made_again_from_the_same_line_is_read_once():
    first, again, elsewhere = stop("zerotune.a", line=3), stop("zerotune.a", line=3), stop("zerotune.a", line=4)
    assert walk.read_once([first, again, elsewhere]) == [first, elsewhere]


def test_a_thread_is_read_where_it_was_started():
    main = [stop("zerotune.a"), stop("zerotune.b"), stop("zerotune.c")]
    checks = [stop("zerotune.x", thread="checks"), stop("zerotune.y", thread="checks")]
    mixed = [main[0], checks[0], main[1], checks[1], main[2]]  # in time order
    ordered = walk.in_reading_order(mixed, {"checks": ("MainThread", 2)})
    assert [s["module"] for s in ordered] == ["zerotune.a", "zerotune.b", "zerotune.x", "zerotune.y", "zerotune.c"]


def test_the_tracer_follows_the_config_and_what_is_made_from_it(tmp_path):
    from zerotune.rundir import JobSpec, run_name

    tracer = walk.Tracer("job", walk.STEP, tmp_path)
    spec = JobSpec(run_dir=str(tmp_path), overrides=["zero_stage=2"])
    tracer.taint(spec)
    tracer.start()
    try:
        run_name(["train.max_steps=1"])  # given nothing made from the config: no stop
        saved = dataclasses.replace(spec, from_parent=True)  # a dataclass's own __init__: made from it, no stop
        saved.save()
    finally:
        tracer.stop_tracing()
    functions = [s["function"] for s in tracer.stops]
    assert functions[:2] == ["JobSpec.save", "write_json_atomic"]
    assert "run_name" not in functions and "__init__" not in functions
    assert {s["module"] for s in tracer.stops} <= {"zerotune.rundir", "zerotune.config.files"}


def test_help():
    with pytest.raises(SystemExit) as exc:
        walk.main(["--help"])
    assert exc.value.code == 0


def test_the_walk_of_the_default_job_reaches_its_training_step(tmp_path, capsys):
    out = tmp_path / "walk.json"
    assert walk.main(["--list", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    stops = figures["stops"]
    assert figures["reached_step"]
    step_module, step_function = walk.STEP.split(":")
    assert (stops[0]["module"], stops[0]["function"]) == ("zerotune.job.parent", "run_job")
    assert (stops[-1]["module"], stops[-1]["function"]) == (step_module, step_function)
    assert any((s["module"], s["function"]) == ("zerotune.job.worker", "main") for s in stops)
    assert all(s["module"].startswith(walk.OWN) for s in stops)
    assert figures["parent"]["stops"] + figures["worker"]["stops"] == figures["total"]["stops"] == len(stops)
    # The split by thread covers every stop once: the main threads' way and the checks' branch beside it.
    assert figures["main_threads"]["stops"] + figures["other_threads"]["stops"] == len(stops)
    assert figures["other_threads"]["stops"] > 0 and all(s["thread"] == "MainThread" for s in stops[-3:])

    # The counters agree with the stops as listed: `>` a new room, `<` a return, `^` a climb.
    layers = walk.read_layers()
    modules = [s["module"] for s in stops]
    total = figures["total"]
    assert total == walk.figures(stops, layers)
    assert total["rooms"] == len(set(modules)) and total["returns"] == walk.count_returns(modules)
    listed = [line for line in capsys.readouterr().out.splitlines() if line[:4].strip().isdigit()]
    assert len(listed) == total["stops"]
    assert sum(line[5] == ">" for line in listed) == total["rooms"]
    assert sum(line[5] == "<" for line in listed) == total["returns"]
    assert sum("^ climb" in line for line in listed) == total["climbs"] == len(figures["climbs"])
    assert len(figures["rises"]) == total["rises"]

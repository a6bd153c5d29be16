"""What torch really allocates on this CPU for one whole training step (forward, backward and the optimizer's
step), one rank, through zerotune's own Trainer: the measurement the planner's `--device cpu` prediction is
checked against (benchmarks/bench_plan_step.py, tests/test_plan_step.py).

torch.profiler records every CPU allocation and free, in order. It runs from before the U-Net is built to the
end of the measured step, so the running total of those events is what the process's tensors hold at every
instant (the few tensors made at import time are not in it; none of them is freed in between). The measured
step is the second: the first allocates the optimizer's states lazily, and a step's peak is the steady one.

    python benchmarks/step_alloc.py model=tiny zero_stage=2 offload=cpu precision=bf16   # prints JSON
"""

from __future__ import annotations

import bisect
import itertools
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Small and quick: the step's structure (model states, buffers, the optimizer's transients) is what is checked.
QUICK = ("data=synthetic", "train.batch_size=2", "train.max_steps=2", "evaluate.enabled=false", "ema.enabled=false",
         "scheduler=constant", "logger=none", "launch.num_processes=1")
RESOLUTION = {"tiny": 16, "sdxl_tiny": 64}
STEP = "zerotune.measured_step"


def measure(overrides: list[str]) -> dict:
    """Bytes held when the second step starts, its peak between ops and at any instant (kernel scratch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from zerotune.config.compose import compose
    from zerotune.config.compose.settle import settle
    from zerotune.plan.resolve import check
    from zerotune.rundir import RunDir
    from zerotune.rundir.loggers import NullLogger
    from zerotune.train import distributed
    from zerotune.train.trainer import Trainer

    cfg = compose(overrides)
    distributed.ensure_single_process_env()
    run = check(settle(cfg, overrides, 1))
    distributed.init_accelerate_state(run.use_deepspeed, 600)
    with tempfile.TemporaryDirectory() as tmp, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(run, RunDir(tmp, is_writer=True), NullLogger())
        trainer.train_step()
        with record_function(STEP):
            trainer.train_step()
        optimizer = trainer.optimizer_class()
    events = prof.profiler.kineto_results.events()
    return {"overrides": overrides, "optimizer_class": optimizer, "torch": torch.__version__, **_window(events)}


def _name(event) -> str:
    try:
        return event.name()
    except UnicodeDecodeError:  # a Python frame's name under with_stack=True can be undecodable
        return ""


def _window(events: list) -> dict:
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if _name(e) == "[memory]")
    times, totals = [t for t, _ in memory], list(itertools.accumulate(n for _, n in memory))
    step = next(e for e in events if _name(e) == STEP)
    first, last = bisect.bisect_left(times, step.start_ns()), bisect.bisect_right(times, step.end_ns())
    held = totals[first - 1] if first else 0
    ends = [e.end_ns() for e in events if _name(e).startswith("aten::") and step.start_ns() <= e.end_ns() <= step.end_ns()]
    between = [totals[i - 1] for i in (bisect.bisect_right(times, end) for end in ends) if i]
    return {"held_at_start": held, "peak_between_ops": max([held, *between]),
            "peak_any_instant": max([held, *totals[first:last]]), "held_at_end": totals[last - 1] if last else 0}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    args = sys.argv[1:]
    model = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), "tiny")
    extra = [] if any(a.startswith("resolution=") for a in args) else [f"resolution={RESOLUTION.get(model, 16)}"]
    print(json.dumps(measure([*QUICK, *extra, *args])))

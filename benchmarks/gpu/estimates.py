"""Seconds each piece of the GPU kit takes on an H100 80GB, worked out from the kit's recorded runs
(RECORDS/raw/: each call's files as they came back), so that a call plans what fits its budget before it starts.

A row costs a fixed part (zerotune's start and checks, the planner, building SDXL, DeepSpeed's setup, the first
steps' extra, the exit: the recorded wall less its steps) plus its steps at the recorded seconds per step; the
steps are the row's own (its composed train.max_steps). A piece that never ran on a card has an allowance
instead, and the plan says so. tests/test_gpu_kit_first.py checks these figures against the
records.
"""

from __future__ import annotations

from dataclasses import dataclass

RECORDS = "experiments/results/gpu/h100-2026-11-26"


@dataclass(frozen=True)
class Cost:
    fixed_s: float
    step_s: float
    basis: str             # where the figures come from, or why an allowance

    @classmethod
    def allowance(cls, seconds: float, why: str) -> Cost:
        """A piece never run on a card."""
        return cls(seconds, 0.0, f"allowance, unmeasured: {why}")

    def seconds(self, steps: int) -> float:
        return self.fixed_s + steps * self.step_s

    def describe(self, steps: int) -> str:
        if not self.step_s:
            return self.basis
        return f"{self.fixed_s:.1f} s + {steps} steps x {self.step_s:.2f} s, from {self.basis}"


def from_median(source: str, wall_s: float, steps: int, median_s: float) -> Cost:
    """A recorded row (`source`: its call and name): `wall_s` for `steps` steps, zerotune's median s/step."""
    return Cost(round(wall_s - steps * median_s, 1), median_s,
                f"raw/{source}: {wall_s} s, {steps} steps, median {median_s} s")


def from_steps(source: str, wall_s: float, step_times: tuple[float, ...], built_s: float = 0.0) -> Cost:
    """A recorded row too short for a median: each step's seconds (its metrics.jsonl), their mean per step;
    `built_s` of its wall was a JIT build."""
    return Cost(round(wall_s - built_s - sum(step_times), 1), round(sum(step_times) / len(step_times), 2),
                f"raw/{source}: {wall_s} s, steps " + ", ".join(f"{t:.2f}" for t in step_times) + " s")


# DeepSpeed's CPU-Adam JIT build on the card: the same job run first on a bare machine (phases_128_bs8_kept,
# 193.5 s) and again with the op cached (phases_128_bs8_empty_cache, 101.3 s). zerotune builds it in the launch
# checks of the first job with offload=cpu, and records it in that run's summary.json (ops_build).
CPU_ADAM_BUILD_S = round(193.5 - 101.3, 1)
CPU_ADAM_BASIS = "raw/call1: phases_128_bs8_kept, first on a bare machine, 193.5 s, less its twin's 101.3 s"

# ZeRO-2 + CPU offload, synthetic latents, the op cached (raw/call2): each row's median s/step.
REF_1024_BS8 = from_median("call2 ref_1024_bs8", 149.3, 20, 2.65)
REF_128_BS8 = from_median("call2 ref_128_bs8", 171.1, 20, 2.93)
REF_1024_BS1 = from_median("call2 ref_1024_bs1_8gib", 146.0, 10, 3.91)
# The empty_cache row; its twin (kept), run first, also built CPU-Adam.
PHASES_128_BS8 = from_median("call1 phases_128_bs8_empty_cache", 101.3, 10, 2.39)

# SDXL 512², 3 steps each, timed in its metrics.jsonl; z2_cpu_512_bs1 ran first on a bare machine.
GRID = {
    "z2_cpu_512_bs1": from_steps("grid-call1 z2_cpu_512_bs1", 192.0, (9.93, 3.36, 2.88), CPU_ADAM_BUILD_S),
    "z2_none_512_bs1": from_steps("grid-call1 z2_none_512_bs1", 55.9, (2.65, 1.15, 1.36)),
    "z3_cpu_512_bs1": from_steps("grid-call1 z3_cpu_512_bs1", 102.2, (8.84, 25.13, 4.44)),
    "z3_none_512_bs1": from_steps("grid-call1 z3_none_512_bs1", 81.5, (6.66, 30.71, 3.17)),
    "z1_none_512_bs1": from_steps("grid-call2 z1_none_512_bs1", 62.3, (3.12, 1.11, 1.44)),
    "z2_none_512_bs4": from_steps("grid-call2 z2_none_512_bs4", 81.4, (3.22, 1.84, 1.58)),
    "z3_cpu_512_bs4": from_steps("grid-call2 z3_cpu_512_bs4", 143.3, (11.00, 37.16, 6.73)),
}
# The loading part's ZeRO-3 row (parameters and optimizer on the host, 1024² batch 8, 10 steps) has never run on a
# card: its fixed part is z3_cpu_512_bs4's (143.3 s less its 3 steps, 54.9 s), plus 60 s for ZeRO-3's slow first
# steps (11.0 and 37.2 s at 512² batch 4: the second traces the module order), and 12 s a step (6.7 s at 512²
# batch 4, 8x fewer pixels per step), and 50 s for the job's plan, which now replays ZeRO-3's step before training
# (about 45 s for SDXL on this CPU, plan/zero3_replay.py; the grid rows ran before it): an allowance, unmeasured.
Z3_PARAMS_1024_BS8 = Cost(round(143.3 - (11.00 + 37.16 + 6.73) + 60 + 50, 1), 12.0,
                          "allowance, unmeasured: never run at 1024² batch 8; raw/grid-call2 z3_cpu_512_bs4's fixed "
                          "88.4 s, + 60 s for ZeRO-3's slow first steps, + 50 s for the job plan's ZeRO-3 replay, "
                          "12 s a step (6.73 s at 512² batch 4)")
GRID_UNRECORDED = Cost.allowance(150, "never run on a card; above the slowest recorded grid row (z3_cpu_512_bs4, "
                                      "143.3 s)")

# The flux part's rows have never run on a card: FLUX.1's and SD3.5 Medium's random init under zero.Init, the job's
# plan (its ZeRO-3 replay of a 11.9B transformer: about 50 s on this CPU), then 3 steps with the parameters fetched
# from the host each forward and backward (22.7 GiB of bf16 for FLUX.1, about 1 s each way at 25 GB/s).
FLUX_LORA = Cost.allowance(300, "never run on a card: FLUX.1's build under zero.Init, a plan of ~60 s, 3 steps")
SD35_MEDIUM = Cost.allowance(180, "never run on a card: SD3.5 Medium's build under zero.Init, its plan, 3 steps")
FLUX_SKIPPED = Cost.allowance(90, "the job's checks and plan only: the guard skips it (predicted host OOM)")

# The env probe's one run on a card (an H200, `first`, a bare machine); the paths part has not run on one yet.
ENV_PROBE = Cost(19.2, 0.0, "measured: 19.2 s on an H200 (experiments/results/gpu/h200-2026-11-27/first.json)")
PATHS = Cost.allowance(240, "pytest -m cuda (six sdxl_tiny runs) has never run on a card")

"""The sweeper's settings (conf/hydra/sweeper/tune.yaml), checked; and the candidates: a knob given one value is
fixed, a list bounds it, an unnamed one takes `hydra.sweeper.space`'s values, any other key is the workload (a list
there is refused). Each candidate is composed, validated and planned before any trial; one refused, predicted not to
fit, or the same run as an earlier one is dropped with its reason. train.grad_accum is derived for the global batch."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from zerotune.config.compose.overrides import as_typed, typed_line
from zerotune.config.compose.settle import Settled
from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config, as_dict
from zerotune.rundir.plan import Plan
from zerotune.rundir.summary import Status
from zerotune.train.rungs import PRUNERS


@dataclass(frozen=True)
class TuneSettings:
    name: str | None = None              # the winner's file: experiment/tuned_<name>.yaml
    global_batch: int | None = None      # samples per optimizer step; None: as the command line composes
    gpu: str | None = None               # a card not present: rank by the planner, run nothing
    n_trials: int | None = None          # None: every candidate the planner keeps
    seed: int = 0
    warmup_steps: int = 3
    min_steps: int = 4
    reduction_factor: int = 3
    max_steps: int = 12                  # the search only finds the finalists: their rounds are the measurement
    pruner: str = "successive_halving"
    min_spread: float = 0.10             # the least relative spread of a figure (rungs, finalists' rounds)
    finalists: int = 4                   # at most this many, within the spread of the best, are re-measured
    pair_rounds: int = 3                 # rounds of the finalists' re-measurement (0: none)
    pair_steps: int = 12                 # timed steps of each of those runs
    extra_rounds: int = 2                # more rounds for a close call (finalists.Comparison.close): 0 for none
    drop_by_plan: bool = True            # false: what the planner predicts won't fit (or needlessly checkpoints) runs too
    warm_workers: bool = True            # trials' workers forked from one process that imported once (job/warm.py)
    space: dict[str, Any] = field(default_factory=dict)

    def trial_overrides(self) -> list[str]:
        """What every trial's job is told of the rungs (schema `trial`)."""
        return [f"trial.warmup_steps={self.warmup_steps}", f"trial.min_steps={self.min_steps}",
                f"trial.reduction_factor={self.reduction_factor}", f"trial.max_steps={self.max_steps}",
                f"trial.pruner={self.pruner}", f"trial.min_spread={self.min_spread}"]

    def round_overrides(self) -> list[str]:
        """What a finalist's re-measurement job is told: one rung of pair_steps, never stopped."""
        return [f"trial.warmup_steps={self.warmup_steps}", f"trial.min_steps={self.pair_steps}",
                f"trial.max_steps={self.pair_steps}", "trial.pruner=none", f"trial.min_spread={self.min_spread}"]


def read_settings(params: dict[str, Any]) -> TuneSettings:
    """TuneSettings from the sweeper's config node, every value checked."""
    known = TuneSettings.__dataclass_fields__
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(f"hydra.sweeper.{unknown[0]}", "not a setting of hydra/sweeper=tune",
                          f"one of: {', '.join(known)}")
    settings = TuneSettings(**{k: v for k, v in params.items() if k in known})
    _check_positive(settings, ("warmup_steps", "pair_rounds", "extra_rounds"), minimum=0)
    _check_positive(settings, ("min_steps", "max_steps", "global_batch", "n_trials", "finalists", "pair_steps"),
                    minimum=1)
    if isinstance(settings.min_spread, bool) or not isinstance(settings.min_spread, int | float) \
            or not 0 <= settings.min_spread < 1:
        raise ConfigError("hydra.sweeper.min_spread", f"must be a fraction in [0, 1), got {settings.min_spread!r}",
                          "hydra.sweeper.min_spread=0.1")
    _check_positive(settings, ("reduction_factor",), minimum=2)
    for key in ("drop_by_plan", "warm_workers"):
        if not isinstance(getattr(settings, key), bool):
            raise ConfigError(f"hydra.sweeper.{key}", f"must be true or false, got {getattr(settings, key)!r}",
                              f"hydra.sweeper.{key}=true")
    if settings.pruner not in PRUNERS:
        raise ConfigError("hydra.sweeper.pruner", f"unknown {settings.pruner!r}",
                          f"hydra.sweeper.pruner={' | '.join(PRUNERS)}")
    if settings.max_steps < settings.min_steps:
        raise ConfigError("hydra.sweeper.max_steps", f"{settings.max_steps} is below min_steps {settings.min_steps}",
                          f"hydra.sweeper.max_steps={settings.min_steps * settings.reduction_factor}")
    return settings


def _check_positive(settings: TuneSettings, keys: tuple[str, ...], minimum: int) -> None:
    for key in keys:
        value = getattr(settings, key)
        if value is None and key in ("global_batch", "n_trials"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"hydra.sweeper.{key}", f"must be a whole number >= {minimum}, got {value!r}",
                              f"hydra.sweeper.{key}={max(minimum, _suggested(key))}")


def _suggested(key: str) -> int:
    """A field's default, as the value a refusal suggests: 1 where the default is None or 0."""
    default = TuneSettings.__dataclass_fields__[key].default
    return default if isinstance(default, int) and default else 1


KNOBS = ("zero_stage", "offload", "optimizer", "train.batch_size", "train.gradient_checkpointing", "deepspeed.overlap_comm",
         "deepspeed.reduce_bucket_size", "deepspeed.allgather_bucket_size", "deepspeed.stage3_prefetch_bucket_size",
         "launch.num_processes", "launch.threads")
# ZeRO's own settings: DeepSpeed reads them at stages 1-3 only, so stage 0 tries their first value alone.
ZERO_ONLY = ("deepspeed.overlap_comm", "deepspeed.reduce_bucket_size", "deepspeed.allgather_bucket_size",
             "deepspeed.stage3_prefetch_bucket_size")
AUTO_MICRO_BATCHES = 3  # train.batch_size: auto tries the largest three powers of two that divide a rank's share


@dataclass(frozen=True)
class Candidate:
    knobs: dict[str, str]                 # knob -> value, as Hydra reads it on a command line
    grad_accum: int

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.knobs.items()] + [f"train.grad_accum={self.grad_accum}"]

    def label(self) -> str:
        return _label(self.knobs)


@dataclass
class CommandLine:
    workload: list[str] = field(default_factory=list)     # the same in every trial
    accumulation: list[str] = field(default_factory=list)  # train.grad_accum as given: for the global batch only
    values: dict[str, list[str]] = field(default_factory=dict)  # knob -> its values, given or bounded

    @property
    def fixed(self) -> set[str]:
        """The knobs given one value."""
        return {key for key, given in self.values.items() if len(given) == 1}


def read_command_line(arguments: list[str]) -> CommandLine:
    """Split the sweep's overrides, as Hydra's own parser reads them, into the workload and the knobs."""
    line = CommandLine()
    for o in OverridesParser.create().parse_overrides(arguments):
        key = o.get_key_element().lstrip("+~")
        if key == "train.grad_accum":
            line.accumulation.append(typed_line(o))  # read once, for the global batch; each trial gets its own
        elif key in KNOBS:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            line.values[key] = values
        elif o.is_sweep_override():
            raise ConfigError(key, "a list here would compare different workloads: tune searches one workload's "
                                   f"knobs ({', '.join(KNOBS)})",
                              f"give {key} one value, and run one tune per value")
        else:
            line.workload.append(typed_line(o))
    return line


def knob_values(line: CommandLine, space: dict[str, Any], gpus: int) -> dict[str, list[str]]:
    """Every knob's values: the command line's, else the space's (auto expanded), else one: unset."""
    values: dict[str, list[str]] = {}
    for key in KNOBS:
        if key in line.values:
            values[key] = line.values[key]
        elif key in space and key != "train.batch_size":
            given = space[key]
            values[key] = _auto(key, gpus) if given == "auto" else [_text(v) for v in _as_list(given)]
    return values


def candidates(values: dict[str, list[str]], global_batch: int, nnodes: int,
               batch_space: Any) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The product of the knobs' values, each with its micro batch and accumulation; and what was left out, why."""
    keys = [k for k in values if k != "train.batch_size"]
    out, dropped, seen = [], [], set()
    for combo in itertools.product(*(values[k] for k in keys)):
        knobs = dict(zip(keys, combo, strict=True))
        if str(knobs.get("zero_stage", "")).strip("'\"") == "0":
            if any(knobs.get(k) != values[k][0] for k in ZERO_ONLY if k in knobs):
                continue  # the same run as with the first value
        ranks = int(knobs.get("launch.num_processes", 1)) * nnodes
        if global_batch % ranks:
            dropped.append((_label(knobs), f"the global batch {global_batch} does not divide among {ranks} ranks"))
            continue
        share = global_batch // ranks
        micro = values.get("train.batch_size") or _micro_batches(share, batch_space)
        for m in micro:
            full = {**knobs, "train.batch_size": str(m)}
            if share % int(m):
                dropped.append((_label(full), f"micro batch {m} does not divide a rank's {share} samples"))
            elif _label(full) not in seen:
                seen.add(_label(full))
                out.append(Candidate(full, share // int(m)))
    return out, dropped


def _micro_batches(share: int, batch_space: Any) -> list[str]:
    if batch_space not in (None, "auto"):
        return [_text(v) for v in _as_list(batch_space)]
    powers = [2 ** i for i in range(share.bit_length()) if share % 2 ** i == 0]
    choices = sorted({*powers, share}, reverse=True)[:AUTO_MICRO_BATCHES]
    return [str(m) for m in choices]


def _auto(key: str, gpus: int) -> list[str]:
    """launch.num_processes: every GPU here (one process each); a CPU host: 1, 2, 4 ... up to its cores.
    Anything else: its own default (auto)."""
    if key != "launch.num_processes":
        return ["auto"]
    if gpus:
        return [str(gpus)]
    cores = len(os.sched_getaffinity(0))
    return [str(2 ** i) for i in range(cores.bit_length()) if 2 ** i <= cores]


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _label(knobs: dict[str, str]) -> str:
    """As a user types them: zero_stage=2, not Hydra's zero_stage='2'."""
    return " ".join(as_typed([f"{k}={v}" for k, v in knobs.items()]))


KEPT, INVALID, SAME, SLOWER = "kept", "invalid", "duplicate", "dominated"
NO_FIT = Status.PREDICTED_OOM  # the word a job the guard skipped records: the tune report's column shows both
CHECKPOINTING = "train.gradient_checkpointing"


@dataclass
class Screened:
    number: int                       # the candidate's place in the space, from 0
    candidate: Candidate
    verdict: str                      # kept | invalid | predicted_oom | duplicate | dominated
    reason: str = ""
    plan: dict = field(default_factory=dict)   # peak MiB, time floor and what binds it


def screen(found: list[Candidate], workload: list[str], settle: Callable[[list[str]], Settled],
           gpu_name: str | None) -> list[Screened]:
    """Each candidate's verdict. `settle`: overrides -> the job's settled config; `gpu_name`: plan for that card
    (not present) rather than this machine."""
    from zerotune.plan import gpus
    from zerotune.plan.guard import job_gpu, job_plan
    from zerotune.plan.resolve import check

    out: list[Screened] = []
    runs: dict[str, int] = {}  # a resolved config (_run_key): the first candidate that runs it
    for number, candidate in enumerate(found):
        overrides = [*workload, *candidate.overrides()]
        try:
            run = check(settle(overrides))
            gpu = gpus.lookup(gpu_name, None) if gpu_name else job_gpu(run.config)
            plan = job_plan(run, gpu)
        except ConfigError as exc:
            out.append(Screened(number, candidate, INVALID, f"{exc.key}: {exc.problem} (fix: {exc.fix})"))
            continue
        same = runs.setdefault(_run_key(run.config), number)
        problems = [] if "error" in plan else _problems(plan, gpu_name)
        verdict, reason = ((SAME, f"the same run as candidate {same}") if same != number else
                           (NO_FIT, "; ".join(problems)) if problems else (KEPT, plan.error or ""))
        out.append(Screened(number, candidate, verdict, reason, _plan_view(plan)))
    return _drop_needless_checkpointing(out)


def _drop_needless_checkpointing(found: list[Screened]) -> list[Screened]:
    """Gradient checkpointing only adds a forward's recomputation: it is worth a trial only where the same run
    without it is predicted not to fit."""
    without = {_twin_key(s.candidate): s for s in found if str(s.candidate.knobs.get(CHECKPOINTING)).lower() == "false"}
    for s in found:
        twin = without.get(_twin_key(s.candidate))
        if s.verdict == KEPT and str(s.candidate.knobs.get(CHECKPOINTING)).lower() == "true" and twin is not None \
                and twin.verdict == KEPT:
            s.verdict = SLOWER
            s.reason = (f"candidate {twin.number}, the same without gradient checkpointing, is predicted to fit; "
                        "checkpointing only adds recomputation")
    return found


def _twin_key(candidate: Candidate) -> str:
    return " ".join(f"{k}={v}" for k, v in candidate.knobs.items() if k != CHECKPOINTING)


def _problems(plan: Plan, gpu_name: str | None) -> list[str]:
    from zerotune.plan.guard import memory_problems

    if gpu_name:  # a card not here: its whole memory, as the catalog gives it
        return [] if plan.fits is not False else [
            f"predicted GPU peak {plan.run_peak_mib or plan.gpu_peak_mib:,.0f} MiB is above the "
            f"{gpu_name}'s memory"]
    return memory_problems(plan)


def _run_key(cfg: Config) -> str:
    """Two candidates that resolve to the same config (zero_stage=2 and zero_stage='2') are one run."""
    return json.dumps(as_dict(cfg), sort_keys=True, default=str)


def planned_peak_mib(plan: dict) -> float | None:
    """A screened candidate's predicted peak: the run's, else the GPU's, else the step's."""
    return plan.get("run_peak_mib") or plan.get("gpu_peak_mib") or plan.get("step_peak_mib")


def _plan_view(plan: Plan) -> dict:
    view = {k: getattr(plan, k) for k in ("gpu_peak_mib", "run_peak_mib", "host_peak_mib", "step_peak_mib",
                                          "time_floor_s", "bound")}
    view["host_need_mib"] = (plan.host_fit or {}).get("needed_mib")
    terms = plan.time_terms
    view["terms"] = {t.term: t.seconds for t in terms if t.seconds is not None}
    view["terms_unknown"] = [f"{t.term} ({t.note or 'unmeasured'})" for t in terms if t.seconds is None]
    return view

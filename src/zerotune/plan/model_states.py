"""Per-rank model states (parameters, gradients, master weights, optimizer states) and buffers, predicted from the
parameter sizes and the validated DeepSpeed dict: one record of what the rules read (`Partitioning`) over each
stage family's rules (stage0.py, zero12.py, zero3.py: DeepSpeed 0.19.8's own, padding included, read from its
source)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING

from zerotune.config.schema import Adapter, Model
from zerotune.plan import stage0, zero3, zero12
from zerotune.plan.rules import Precision, numels_of, precision_of, zero_config
from zerotune.rundir.plan import Term

if TYPE_CHECKING:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from zerotune.plan.resolve import ResolvedRun


def rules_for(stage: int) -> ModuleType:
    """The module holding stage `stage`'s rules (0 also for plain accelerate: nothing partitioned)."""
    return {0: stage0, 1: zero12, 2: zero12, 3: zero3}[stage]


# Plain accelerate keeps fp32 weights (autocast for bf16/fp16) and builds torch's optimizer on them.
_PLAIN = Precision("fp32", 4, 4, 4, False)


@dataclass(frozen=True)
class Partitioning:
    """What the stage rules read, parsed once: every parameter's size (model.parameters() order), the validated
    DeepSpeed dict, the world. `trainable_numels`: the optimizer's (None: all); `groups`: parameters per optimizer
    group (ModelStats.trainable_groups; None: one group); `client_optimizer`: ResolvedRun.client_optimizer;
    `trainable_shapes`: for stage 0 (Adafactor factors by shape); `device`: where plain accelerate's step runs (on
    a CPU, accelerate wraps even one process in DDP); `precision`: the config's, checked against the dict's."""

    param_numels: list[int]
    ds_config: dict
    world_size: int
    use_deepspeed: bool = True
    trainable_numels: list[int] | None = None
    groups: list[int] | None = None
    client_optimizer: dict | None = None
    trainable_shapes: list[tuple[int, ...]] | None = None
    device: str = "cuda"
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"a world of {self.world_size} ranks")
        if self.use_deepspeed and self.precision is not None and self.precision != self.prec.name:
            raise ValueError(f"precision {self.precision!r} disagrees with the DeepSpeed dict's {self.prec.name!r}")

    @classmethod
    def of(cls, resolved: ResolvedRun, world_size: int, device: str = "cuda") -> Partitioning:
        """The resolved run's: its parameters as a meta-device build counts them, its optimizer groups."""
        stats = resolved.model_stats
        return cls(list(stats.param_numels), resolved.ds_config, world_size, resolved.use_deepspeed,
                   list(stats.trainable_numels) or None, resolved.group_sizes(), resolved.client_optimizer,
                   stats.trained_shapes(), device, resolved.config.precision.name)

    @cached_property
    def numels(self) -> list[int]:
        return numels_of(self.param_numels)[0]

    @cached_property
    def train(self) -> list[int]:
        """The optimizer's parameters' sizes."""
        return numels_of(self.param_numels, self.trainable_numels)[1]

    @cached_property
    def prec(self) -> Precision:
        return precision_of(self.ds_config) if self.use_deepspeed else _PLAIN

    @cached_property
    def zero(self) -> DeepSpeedZeroConfig | None:
        return zero_config(self.ds_config) if self.use_deepspeed else None

    @cached_property
    def rules(self) -> ModuleType:
        return rules_for(int(self.zero.stage) if self.zero is not None else 0)

    @cached_property
    def states(self) -> dict:
        """A rank's bytes of parameters, gradients, master weights and optimizer states (every rank's alike:
        DeepSpeed pads the partitions to one size) as train/engine.py's `partition_bytes` reads them after step 1,
        with `where` each lives (gpu | host) and the element sizes; `trainable_params_bytes`: what of
        `params_bytes` the optimizer updates."""
        extra = {"plain": True} if not self.use_deepspeed else {}
        return self.rules.states(self.numels, self.train, self.ds_config, self.world_size, self.prec, self.zero,
                                 client=self.client_optimizer, shapes=self.trainable_shapes, groups=self.groups,
                                 **extra)

    def buffers(self, rank: int | None = None) -> list[Term]:
        """Every buffer of this configuration, named, with its source; `rank` None: the largest over ranks. Plain
        accelerate's are stage0.plain_buffers' (DDP's, gradients kept across micro-steps), on `device`."""
        if rank is not None and not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        if not self.use_deepspeed:
            return stage0.plain_buffers(self.ds_config, self.train, self.world_size, self.device)
        return self.rules.buffers(self.ds_config, self.numels, self.train, self.world_size, rank, self.prec,
                                  self.zero, self.groups)

    def gpu_buffer_bytes(self, rank: int | None = None) -> dict[str, int]:
        """{name: bytes} of the GPU buffers a planner adds to the model states (overlapping terms left out;
        the stage-2 contiguous-gradients buffer counts only what it holds beyond the gradient partition)."""
        alone, wider, grads = self._placed("gpu", rank)
        return {**alone, **{t.term: max(0, t.nbytes - grads) for t in wider}}

    def host_buffer_bytes(self, rank: int | None = None) -> dict[str, int]:
        """{name: bytes} of DeepSpeed's pinned host buffers beyond the model states (offload staging, swap)."""
        alone, wider, grads = self._placed("host", rank)
        # ZeRO-2 offload holds the gradient partition in fp32, wider than the parameters' dtype: the excess counts
        return {**alone, **{t.term + "_beyond_grads": t.nbytes - grads for t in wider if t.nbytes > grads}}

    def _placed(self, where: str, rank: int | None) -> tuple[dict[str, int], list[Term], int]:
        """({name: bytes} of the buffers in `where` overlapping no model state, those sharing the gradients', grads)."""
        terms = [t for t in self.buffers(rank) if t.where == where]
        wider = [t for t in terms if t.overlaps == "grads_bytes"]
        grads = self.states["grads_bytes"] if wider else 0
        return {t.term: t.nbytes for t in terms if not t.overlaps}, wider, grads


def param_numels(model_cfg: Model, adapter_cfg: Adapter | None = None) -> tuple[list[int], list[int]]:
    """Every parameter's size and the trainable ones' (adapter_cfg: the run's `adapter`), in
    model.parameters() order, from a meta-device build."""
    from zerotune.models import model_stats

    stats = model_stats(model_cfg, adapter_cfg)
    return numels_of(stats.param_numels, stats.trainable_numels or None)

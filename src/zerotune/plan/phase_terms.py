"""The loading phase (phases.py): what DeepSpeed 0.19.8's engine and ZeRO optimizer allocate on the GPU while
they take the U-Net, term by term, each with the line that allocates it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from zerotune.plan import allocator, encoders
from zerotune.schema import launch_world_size

MIB = 2**20
ELEM = {"fp32": 4, "bf16": 2, "fp16": 2}
_S12 = "runtime/zero/stage_1_and_2.py"


def term(name: str, nbytes: float, note: str) -> dict:
    return {"term": name, "mib": nbytes / MIB, "note": note}


def state_mib(plan: dict, name: str) -> float:
    """A GPU term of the step's prediction by name (0 when the term is not on the GPU)."""
    return sum(t["mib"] for t in plan["gpu_terms"] if t["term"] == name)


def _stage(checked: Any) -> int:
    return int(checked.ds_config["zero_optimization"]["stage"]) if checked.use_deepspeed else 0


def loading_phase(cfg: Any, checked: Any, gpu: Any, plan: dict, base: list[dict]) -> dict:
    stage = _stage(checked)
    if stage == 3:
        return _zero3(cfg, checked, plan, base)
    if stage in (1, 2):
        return _zero12(cfg, checked, gpu, plan, base)
    return _separate(cfg, checked, plan, base)


def _param_blocks(checked: Any, elem: int) -> tuple[list[int], list[int]]:
    """(every parameter's bytes, the frozen ones'), in the run's dtype: module.to(device) gives each its own block."""
    stats = checked.model_stats
    numels, left = list(stats.param_numels), Counter(stats.trainable_numels or stats.param_numels)
    frozen = []
    for n in numels:  # what the optimizer does not get, as a multiset (order does not matter here)
        if left[n]:
            left[n] -= 1
        else:
            frozen.append(n)
    return [n * elem for n in numels], [n * elem for n in frozen]


def _separate(cfg: Any, checked: Any, plan: dict, base: list[dict]) -> dict:
    """Stage 0 / plain accelerate: the module cast and moved parameter by parameter (engine.py
    _configure_distributed_model: _cast_module_mixed_precision on the host, then module.to(device))."""
    sizes, _ = _param_blocks(checked, ELEM[cfg.precision.name])
    terms = [*base, term("unet_parameters", allocator.reserved_bytes(sizes),
                         "one block per parameter, run dtype (engine.py _configure_distributed_model module.to)")]
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms,
            "source": "engine.py _configure_distributed_model; the optimizer's copies are the step's terms"}


def _zero12(cfg: Any, checked: Any, gpu: Any, plan: dict, base: list[dict]) -> dict:
    """ZeRO-1/2: the parameters arrive one block each (module.to); the optimizer flattens them into one buffer,
    on the GPU when NVML's free memory holds it (stage_1_and_2.py line 453, `flatten_on_accelerator`), else after
    moving them to the host and emptying the cache (line 462); the separate blocks are then freed
    (_update_model_bit16_weights) but stay reserved. The fp32 master partition is cloned on the GPU first
    (`.detach().clone().to(device=self.device, dtype=fp32)`, line 560): a copy of the partition in the run's
    dtype, freed once converted (and moved to the host under offload)."""
    elem, world = ELEM[cfg.precision.name], launch_world_size(cfg.launch)
    sizes, frozen = _param_blocks(checked, elem)
    flat = sum(sizes) - sum(frozen)
    separate = allocator.reserved_bytes(sizes)
    on_gpu = gpu is None or (gpu.memory_mib - sum(t["mib"] for t in base)) * MIB - separate >= flat
    offload = (checked.ds_config["zero_optimization"].get("offload_optimizer") or {}).get("device", "none")
    master = state_mib(plan, "master_weights") * MIB
    clone = 0 if (elem == 4 and offload == "none") else allocator.reserved_bytes([-(-flat // world)])
    where = "no card named: taken as fitting" if gpu is None else f"{gpu.name} holds it"
    blocks = term("unet_parameter_blocks", separate, "one block per parameter, run dtype (engine.py module.to); "
                  + ("freed when the flat buffer takes them, still reserved" if on_gpu else
                     f"moved to the host, released by empty_cache() ({_S12} line 462)"))
    later = [term("flat_parameter_buffer", allocator.reserved_bytes([flat]), f"{_S12} flatten_dense_tensors_aligned"
                  + (f" on the GPU ({where})" if on_gpu else " on the host, then moved")),
             term("master_partition_clone", clone, f"{_S12} line 560: the partition cloned on the GPU before "
                  f".to(fp32, {'host' if offload != 'none' else 'GPU'})" if clone else "fp32: the clone is the master"),
             term("master_weights", master, "fp32 partition on the GPU (the step's term)" if master else
                  "on the host (the step's term)")]
    moments = [blocks, *later] if on_gpu else max([blocks], later, key=lambda ts: sum(t["mib"] for t in ts))
    terms = [*base, *moments]
    end = None if on_gpu else sum(t["mib"] for t in [*base, *later])
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms, "end_live_mib": end,
            "source": f"engine.py _configure_distributed_model; {_S12} DeepSpeedZeroOptimizer.__init__ "
                      f"(empty_cache() at line 449 before flattening releases what earlier phases left)"}


def _zero3(cfg: Any, checked: Any, plan: dict, base: list[dict]) -> dict:
    """ZeRO-3: zero.Init builds each module on the GPU in fp32 and casts it (partition_parameters.py
    zero_wrapper_for_fp_tensor_constructor), then keeps this rank's partition; the optimizer moves the partitions
    to the host, empties the cache and copies them back as one flat buffer (runtime/zero/utils.py defragment,
    line 234); without optimizer offload the fp32 master is `.to(device, fp32).clone()` of each sub-group
    (stage3.py _create_fp32_partitions, line 1170): one sub-group's fp32 copy is transient."""
    elem = ELEM[cfg.precision.name]
    params = (state_mib(plan, "params") + state_mib(plan, "params_persistent")) * MIB
    master = state_mib(plan, "master_weights") * MIB
    module = encoders.largest_module_numel(cfg.model, cfg.adapter)
    build = allocator.reserved_bytes([module * elem, module * 4])
    sub = int(checked.ds_config["zero_optimization"].get("sub_group_size", 1_000_000_000))
    transient = min(master, sub * 4) if master else 0
    terms = [*base, term("params_partitions", params, "this rank's flat partition (the step's params terms)"),
             term("master_weights", master, "fp32 partition on the GPU (the step's term)" if master else
                  "on the host (the step's term)"),
             term("loading_transient", max(build, transient),
                  f"the larger of: one module built whole, fp32 then {cfg.precision.name} ({module:,} elements, "
                  f"{build / MIB:,.1f} MiB), and one fp32 sub-group copy ({transient / MIB:,.1f} MiB)")]
    end = sum(t["mib"] for t in base) + (params + master + transient) / MIB  # the build's blocks were released
    return {"phase": "loading", "peak_mib": sum(t["mib"] for t in terms), "terms": terms, "end_live_mib": end,
            "source": "partition_parameters.py zero.Init; runtime/zero/utils.py defragment empties the cache "
                      "(line 234) before the fp32 partitions are made"}

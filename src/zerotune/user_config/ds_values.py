"""What a value in a user's DeepSpeed JSON asks for: ds_keys refuses a key only when its value asks for what
zerotune's run would not do, and drops one that turns nothing on."""

from __future__ import annotations

from typing import Any


def enabled(value: Any) -> bool:
    """A feature block asks for its feature with `"enabled": true`; DeepSpeed's default is off."""
    if isinstance(value, dict):
        return value.get("enabled", False) not in (False, None)
    return truthy(value)


def truthy(value: Any) -> bool:
    return value not in (None, False, 0, "", {}, [])


def present(value: Any) -> bool:
    return value is not None and value != {}


def any_enabled(value: Any) -> bool:
    """compression_training enables each technique in its own nested block."""
    if isinstance(value, dict):
        return value.get("enabled") not in (None, False) or any(any_enabled(v) for v in value.values())
    return False


def above_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1


def activation_checkpointing(value: Any) -> bool:
    if not isinstance(value, dict):
        return truthy(value)
    switches = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                "synchronize_checkpoint_boundary", "profile")
    return any(truthy(value.get(s)) for s in switches) or value.get("number_checkpoints") is not None


def checkpoint_switches(value: Any) -> bool:
    if not isinstance(value, dict):
        return truthy(value)
    parallel = value.get("parallel_write")
    return (any(truthy(value.get(s)) for s in ("load_universal", "use_node_local_storage", "writer"))
            or (isinstance(parallel, dict) and truthy(parallel.get("pipeline_stage"))))


def tensor_parallel(value: Any) -> bool:
    if not isinstance(value, dict):
        return truthy(value)
    inner = value.get("tp", value.get("tensor_parallel")) or {}
    return above_one(value.get("autotp_size")) or (isinstance(inner, dict) and above_one(inner.get("tp_size")))


def off(value: Any) -> bool:
    """Turns nothing on: false, 0, null, an empty string or container, or a block of such values."""
    if isinstance(value, dict):
        return all(off(v) for v in value.values())
    if isinstance(value, list):
        return all(off(v) for v in value)
    return not truthy(value)


def given(value: Any) -> bool:
    # 0 is a device number here, not "off"
    return value is not None and value != "" and value != [] and value != {}


def comms(value: Any) -> bool:
    return any_enabled(value) if isinstance(value, dict) else truthy(value)


MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet")  # deepspeed/monitor/config.py get_monitor_config


def monitors(value: Any) -> bool:
    """DeepSpeed's monitor is on only through one of its monitors; a block's own "enabled" switches nothing."""
    if not isinstance(value, dict):
        return truthy(value)
    return any(enabled(value.get(m)) for m in MONITORS)


def deepcompile(value: Any) -> bool:
    # Its other fields tune DeepCompile and mean nothing without it.
    return truthy(value.get("deepcompile")) if isinstance(value, dict) else truthy(value)

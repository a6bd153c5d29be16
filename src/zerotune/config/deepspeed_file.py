"""A hand-written DeepSpeed JSON read as DeepSpeed, accelerate and the HF Trainer accept it, against a table of
DeepSpeed 0.19.8's top-level keys (tests/test_ds_file_keys.py compares it with DeepSpeed's parser). Errors and
warnings name keys, never the values of keys they do not know (a pasted secret stays out of stderr, summary.json
and the builder's answers)."""

from __future__ import annotations

import copy
import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from zerotune.config.errors import ConfigError

# honoured: passed on, meaning what it says; translated: an older spelling `translate` rewrites; refused: asks for
# what zerotune's run does not do; ignored: DeepSpeed does not read it, but circulating files carry it.
HONOURED, TRANSLATED, REFUSED, IGNORED = "honoured", "translated", "refused", "ignored"
DOCS = "https://www.deepspeed.ai/docs/config-json/"


# ---- what a value asks for: a key is refused only when its value asks for what zerotune's run would not
# do, and dropped when it turns nothing on


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


# ---- the table


@dataclass(frozen=True)
class Decision:
    kind: str
    reason: str                                   # one line: why
    fix: str = ""                                 # refused, ignored: what to write instead
    asks: Callable[[Any], bool] = present         # refused, ignored: does this value ask for something?
    removed: bool = False                         # DeepSpeed rejects the key itself, whatever its value
    left_out: str = ""                            # why a value asking for nothing is not passed on either

    @property
    def dropped(self) -> str:
        """Why a value asking for nothing is left out of the dict DeepSpeed gets ("" where it is passed on)."""
        if self.kind == IGNORED:
            return self.reason
        return self.left_out or (self.reason if self.removed else "")


def honoured(reason: str) -> Decision:
    return Decision(HONOURED, reason)


def refused(reason: str, fix: str, asks: Callable[[Any], bool] = enabled, removed: bool = False) -> Decision:
    return Decision(REFUSED, reason, fix, asks, removed)


def _delete(key: str) -> str:
    return f'delete "{key}" from the file (or set "enabled": false)'


def _removed(key: str, reason: str, fix: str = "", asks: Callable[[Any], bool] = enabled) -> Decision:
    return refused(f"DeepSpeed 0.19.8 removed {reason}", fix or f'delete "{key}" from the file', asks, removed=True)


def _environment(key: str) -> Decision:
    return Decision(REFUSED, "DeepSpeed does not read it, and the GPUs a process sees are fixed by its environment "
                    "before any file is read", f'delete "{key}" from the file and set the variable where the command '
                    "runs: CUDA_VISIBLE_DEVICES=0,1 zerotune train ...", asks=given,
                    left_out="DeepSpeed does not read it")


KEYS: dict[str, Decision] = {
    # the batch, the optimizer step, precision and ZeRO: what zerotune reads, reports and plans
    "train_batch_size": honoured("global batch; with the other two, DeepSpeed's batch rule (train.batch_size)"),
    "train_micro_batch_size_per_gpu": honoured("micro batch per process (train.batch_size)"),
    "gradient_accumulation_steps": honoured("micro-batches per optimizer step (train.grad_accum)"),
    "gradient_clipping": honoured("global gradient norm clip (train.grad_clip)"),
    "optimizer": honoured("the optimizer block, taken whole (optimizer=)"),
    "scheduler": honoured("the learning-rate schedule, taken whole (scheduler=)"),
    "fp16": honoured("fp16 training and its loss scaler (precision=fp16)"),
    "bf16": honoured("bf16 training (precision=bf16)"),
    "zero_optimization": honoured("ZeRO stage, buckets and offload (zero_stage=, offload=, deepspeed.*)"),
    "aio": honoured("the NVMe offload's asynchronous I/O settings"),
    "data_types": honoured("gradient-accumulation and parameter dtypes; the planner reads grad_accum_dtype too"),
    "communication_data_type": honoured("dtype of the gradient all-reduce"),
    "seq_parallel_communication_data_type": honoured(
        "dtype of sequence-parallel collectives; none run, as sequence_parallel_size is refused"),
    "prescale_gradients": honoured("scale gradients before the all-reduce instead of after"),
    "gradient_predivide_factor": honoured("the divisor applied before the all-reduce"),
    "gradient_allreduce_op": honoured("average or sum in the all-reduce (DeepSpeed refuses sum at stage 3)"),
    "zero_allow_untested_optimizer": honoured("DeepSpeed's gate for optimizers it did not build (zerotune sets it)"),
    "zero_force_ds_cpu_optimizer": honoured("insist on DeepSpeed's CPU-Adam under offload, as zerotune uses"),
    "disable_python_gc": honoured("DeepSpeed's control of Python's garbage collector during steps"),
    # what DeepSpeed prints and times
    "steps_per_print": honoured("DeepSpeed's own log interval (zerotune sets it high; its metrics are its own)"),
    "wall_clock_breakdown": honoured("DeepSpeed prints forward/backward/step timings (they synchronise the device)"),
    "memory_breakdown": honoured("DeepSpeed prints memory use at its log interval"),
    "dump_state": honoured("DeepSpeed prints its engine state after the first step"),
    "log_level": honoured("level of DeepSpeed's logger"),
    "timers": honoured("DeepSpeed's throughput timer"),
    "csv_monitor": honoured("DeepSpeed writes its loss and lr to CSV files at output_path"),
    "vocabulary_size": honoured("read only for a warning about tensor-core alignment; changes nothing"),
    # older spellings
    "bfloat16": Decision(TRANSLATED, 'older name of "bf16"'),
    "fp32_allreduce": Decision(TRANSLATED, 'older form of "communication_data_type": "fp32"'),
    # what zerotune's run does not do
    "fp8": refused('DeepSpeed 0.19.8 has no "fp8" key and would train in the file\'s other precision instead',
                   'delete "fp8" (or set "enabled": false) and enable "bf16" or "fp16" in the file'),
    "torch_autocast": refused("zerotune's precision comes from fp16/bf16 (precision=), which it reports, checks "
                              "and plans; autocast would run a precision none of them describes",
                              'delete "torch_autocast" (or set "enabled": false) and enable "bf16" or "fp16" '
                              "in the file"),
    "activation_checkpointing": refused(
        "DeepSpeed applies it only to deepspeed.checkpointing calls, which a diffusers U-Net never makes",
        'delete "activation_checkpointing"; train.gradient_checkpointing=true checkpoints the U-Net\'s blocks',
        asks=activation_checkpointing),
    "flops_profiler": refused("its profiling step hooks every module and forces wall_clock_breakdown, "
                              "distorting the step time zerotune measures",
                              _delete("flops_profiler") + "; zerotune plan reports the step's FLOPs"),
    "comms_logger": Decision(
        REFUSED, "DeepSpeed prints the log only when the script calls deepspeed.comm.log_summary(), which "
        "zerotune does not", _delete("comms_logger"), enabled,
        # deepspeed/comm/config.py: comms_logger_enabled = 'comms_logger' in ds_config; "enabled" is never read
        left_out='DeepSpeed 0.19.8 turns its comms logger on for any "comms_logger" block, "enabled": false '
                "included, and synchronises the device after every collective"),
    "tensorboard": refused("DeepSpeed would write a second TensorBoard log beside zerotune's logger, with its "
                           "own names", _delete("tensorboard") + "; use logger=tensorboard"),
    "wandb": refused("DeepSpeed would start a second W&B run beside zerotune's logger",
                     _delete("wandb") + "; use logger=wandb"),
    "comet": refused("DeepSpeed's Comet monitor needs comet_ml, which zerotune does not install",
                     _delete("comet") + "; zerotune's metrics are in <run dir>/metrics.jsonl"),
    "autotuning": refused("DeepSpeed's autotuner runs from `deepspeed --autotuning`, not inside a training run",
                          _delete("autotuning") + "; zerotune plan --all ranks stage x offload"),
    "data_efficiency": refused("needs DeepSpeed's data sampler and random-LTD layers; zerotune's data loader "
                               "is its own", _delete("data_efficiency")),
    "pipeline": refused("pipeline parallelism needs a PipelineModule; zerotune trains the U-Net data-parallel",
                        'delete "pipeline"', asks=present),
    "hybrid_engine": refused("DeepSpeed-Chat's RLHF generation engine; zerotune trains a diffusion U-Net",
                             _delete("hybrid_engine")),
    "tensor_parallel": refused("AutoTP shards transformer layers by name; zerotune trains the U-Net data-parallel",
                               'delete "tensor_parallel" (or set autotp_size to 0)', asks=tensor_parallel),
    "sequence_parallel_size": refused("Ulysses sequence parallelism shards a token sequence; a U-Net has none",
                                      'delete "sequence_parallel_size" (or set it to 1)', asks=above_one),
    "expert_parallel": refused("the U-Net has no mixture-of-experts layers", _delete("expert_parallel")),
    "use_data_before_expert_parallelism": refused("lays out mixture-of-experts process groups; the U-Net has none",
                                                  'delete "use_data_before_expert_parallelism"', asks=truthy),
    "weight_quantization": refused("quantises weights as zero.Init builds them; zerotune builds the U-Net whole",
                                   'delete "weight_quantization"', asks=present),
    "compile": refused("DeepCompile applies only when the script calls engine.compile(), which zerotune does not",
                       'delete "compile" (or set "deepcompile": false)', asks=deepcompile),
    "checkpoint": refused("zerotune saves and resumes checkpoints itself (checkpoint.*, resume=): it chooses "
                          "native or universal loading and marks a save complete once written",
                          'keep only "tag_validation" in "checkpoint" (load_universal, use_node_local_storage, '
                          "parallel_write and writer are zerotune's to decide)", asks=checkpoint_switches),
    "datastates_ckpt": refused("asynchronous checkpoints would still be writing when zerotune marks a save "
                               "complete (and need the datastates package)", 'delete "datastates_ckpt"',
                               asks=lambda v: v is not None and v is not False),
    "dataloader_drop_last": refused("zerotune's own data loader always drops the last partial batch",
                                    'delete "dataloader_drop_last" (true is what runs)',
                                    asks=lambda v: v is False),
    "managed_gradient_accumulation": refused(
        "accelerate calls DeepSpeed's step() every micro-batch and relies on DeepSpeed to step on the "
        "accumulation boundary", 'delete "managed_gradient_accumulation" (true is what runs)',
        asks=lambda v: v is False),
    "disable_allgather": refused("DeepSpeed 0.19.8 reads it and never uses it", 'delete "disable_allgather"',
                                 asks=truthy),
    # What only the environment gives: the GPUs a process sees are fixed before any file is read. A value here
    # asks for what zerotune cannot give from a file, so it is refused, not ignored (the run would use other
    # GPUs); the fix sets it where it works.
    "cuda_visible_devices": _environment("cuda_visible_devices"),
    "CUDA_VISIBLE_DEVICES": _environment("CUDA_VISIBLE_DEVICES"),
    # Keys DeepSpeed does not read, seen in circulating files: DeepSpeedConfig's attribute names for the blocks
    # it reads from "comms_logger" and the four monitor keys (deepspeed/runtime/config.py _initialize_params).
    "comms_config": Decision(
        IGNORED, 'its comms logger reads "comms_logger" ("comms_config" is only the name of its Python attribute)',
        'delete "comms_config" from the file (DeepSpeed\'s comms logger prints nothing in a zerotune run)',
        asks=comms),
    "monitor_config": Decision(
        IGNORED, 'its monitors read top-level "tensorboard", "wandb", "csv_monitor" and "comet" ("monitor_config" is '
        "only the name of its Python attribute)",
        'delete "monitor_config" from the file; for DeepSpeed\'s CSV log give "csv_monitor" at the top level '
        "(zerotune's metrics are in <run dir>/metrics.jsonl)", asks=monitors),
    # features DeepSpeed 0.19.8 removed: it refuses the key itself
    "amp": _removed("amp", "its Apex AMP integration",
                    'replace "amp" with "bf16": {"enabled": true} or "fp16": {"enabled": true}'),
    "sparse_attention": _removed("sparse_attention", "sparse attention", asks=present),
    "elasticity": _removed("elasticity", "elastic training",
                           'delete "elasticity" and give train_batch_size or train_micro_batch_size_per_gpu'),
    "nebula": _removed("nebula", "Nebula checkpointing"),
    "compression_training": _removed("compression_training", "its compression library", asks=any_enabled),
    "quantize_training": _removed("quantize_training", "Mixture-of-Quantization training"),
    "eigenvalue": _removed("eigenvalue", "eigenvalue-based quantization"),
    "sparse_gradients": _removed("sparse_gradients", "sparse embedding gradients", asks=truthy),
    "graph_harvesting": _removed("graph_harvesting", "graph harvesting", asks=truthy),
    "curriculum_learning": _removed("curriculum_learning", "top-level curriculum learning"),
    "progressive_layer_drop": _removed("progressive_layer_drop", "progressive layer dropping"),
}


def check(ds: dict, source: str, key: str) -> tuple[dict, list[str]]:
    """`ds` less what asks for nothing of a key DeepSpeed ignores, removed or misreads, and a warning line for
    each key left out; a ConfigError for a file that is not a DeepSpeed config, a misspelt key, or a key whose
    value asks for what the run would not do. `source` names the file; `key` is its setting."""
    if ds and not any(name in KEYS and KEYS[name].kind != IGNORED for name in ds):
        raise ConfigError(key, f"{source} is not a DeepSpeed config: none of its {len(ds)} top-level keys is "
                          "one of DeepSpeed's", f"point {key} at a DeepSpeed JSON file (keys such as "
                          f"zero_optimization, train_micro_batch_size_per_gpu, optimizer; {DOCS})")
    unknown = [name for name in ds if name not in KEYS and (nearest(name) or not off(ds[name]))]
    if unknown:
        first, others = unknown[0], unknown[1:]
        also = f"; also unknown: {', '.join(others)}" if others else ""
        guess = nearest(first)
        if guess:
            raise ConfigError(first, f"DeepSpeed has no top-level key \"{first}\" ({source}){also}",
                              f"rename \"{first}\" to \"{guess}\" in {source}")
        raise ConfigError(first, f"DeepSpeed has no top-level key \"{first}\" and would ignore what its value asks "
                          f"for ({source}){also}", f"delete \"{first}\" from {source} (DeepSpeed's keys: {DOCS})")
    out, warnings = {}, []
    for name, value in ds.items():
        decision = KEYS.get(name)
        if decision is None:  # unknown, and its value turns nothing on
            warnings.append(_ignored_line(source, name, "its value turns nothing on"))
            continue
        ignored = decision.kind == IGNORED
        if decision.kind in (REFUSED, IGNORED) and decision.asks(value):
            why = f"DeepSpeed 0.19.8 ignores this key and what its value asks for: {decision.reason}" \
                if ignored else decision.reason
            raise ConfigError(name, f"{why} ({source})", decision.fix)
        if decision.dropped:
            warnings.append(_ignored_line(source, name, decision.reason) if ignored
                            else f'{source}: dropped "{name}", which asks for nothing: {decision.dropped}')
            continue
        out[name] = value
    return out, warnings


def _ignored_line(source: str, name: str, why: str) -> str:
    return (f'{source}: "{name}" is not a DeepSpeed key, so DeepSpeed ignores it (left out of the run\'s DeepSpeed '
            f"config): {why}")


def nearest(name: str) -> str | None:
    """The honoured key `name` most likely misspells (`gradient_clip` -> `gradient_clipping`)."""
    candidates = [k for k, d in KEYS.items() if d.kind == HONOURED]
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


log = logging.getLogger(__name__)

KEY = "deepspeed.config_file"


class UserFile(NamedTuple):
    ds: dict              # in today's DeepSpeed spelling, less the keys it ignores
    warnings: list[str]   # one line per key left out or translated (summary.json's config_warnings)


def load(path: str, quiet: bool = False) -> UserFile:
    """The file's dict in today's DeepSpeed spelling and its warnings (logged unless `quiet`); a syntax error
    names its line and column, an unknown or refused top-level key its name (never its value: see ds_keys)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(KEY, f"{file} does not exist", f"point {KEY} at a DeepSpeed JSON file")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(KEY, f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                          "fix the JSON at that position") from None
    except UnicodeDecodeError:
        raise ConfigError(KEY, f"{file} is not a text file", f"point {KEY} at a DeepSpeed JSON file") from None
    if not isinstance(data, dict):
        raise ConfigError(KEY, f"{file} must hold a JSON object, not {type(data).__name__}",
                          'wrap the settings in { ... }')
    # The reference's config.json nests the dict under "deepspeed_config"; accept both shapes.
    data = data.get("deepspeed_config", data)
    if not isinstance(data, dict):
        raise ConfigError(KEY, f"\"deepspeed_config\" in {file} must be a JSON object", 'wrap it in { ... }')
    checked, dropped = check(data, file.name, KEY)
    ds, translated = translate(checked, file.name)
    if not quiet:
        for line in dropped + translated:
            log.warning("%s", line)
    return UserFile(ds, dropped + translated)


# zero_optimization keys renamed without a change of meaning.
RENAMED_ZERO = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "allgather_size": "allgather_bucket_size",
}
# Field names DeepSpeed accepts beside their documented aliases; one spelling, so a merge never holds both.
SYNONYMS_ZERO = {
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
}


def translate(ds: dict, source: str) -> tuple[dict, list[str]]:
    """A copy of the user's dict in today's spelling, and one warning line for each change. DeepSpeed would take
    some old spellings silently (`cpu_offload`, escaping zerotune's offload handling) and stop on others."""
    ds = copy.deepcopy(ds)
    notes: list[str] = []

    def warn(old: str, new: str) -> None:
        notes.append(f"{source}: {old} is a deprecated DeepSpeed key; read as {new}")

    if "bfloat16" in ds:  # DeepSpeed's older alias of "bf16"
        warn("bfloat16", "bf16")
        ds["bf16"] = {**ds.pop("bfloat16"), **ds.get("bf16", {})}
    if "fp32_allreduce" in ds:  # older DeepSpeed's flag: all-reduce gradients in fp32
        on = bool(ds.pop("fp32_allreduce"))
        warn(f"fp32_allreduce: {str(on).lower()}", "communication_data_type: \"fp32\"" if on else "nothing")
        if on:
            ds.setdefault("communication_data_type", "fp32")
    zero = ds.get("zero_optimization")
    if isinstance(zero, bool):  # the oldest form: "zero_optimization": true means stage 1
        warn(f"zero_optimization: {str(zero).lower()}", f"zero_optimization: {{\"stage\": {int(zero)}}}")
        ds["zero_optimization"] = {"stage": int(zero)}
    if not isinstance(zero, dict):
        return ds, notes
    for name, alias in SYNONYMS_ZERO.items():
        if name in zero:
            zero.setdefault(alias, zero.pop(name))
    for old, new in RENAMED_ZERO.items():
        if old in zero:
            warn(f"zero_optimization.{old}", f"zero_optimization.{new}")
            zero.setdefault(new, zero.pop(old))
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for old, block in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param"),
                       ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        on = zero.pop(old)
        if block in zero:
            raise ConfigError(f"zero_optimization.{old}", f"both {old} (deprecated) and {block} are set ({source})",
                              f"delete {old}; {block} says where it goes")
        if on:
            zero[block] = {"device": "cpu", "pin_memory": bool(pin)}
            warn(f"zero_optimization.{old}: true",
                 f"zero_optimization.{block}: {{\"device\": \"cpu\", \"pin_memory\": {str(bool(pin)).lower()}}}")
    return ds, notes

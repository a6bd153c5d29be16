"""Build DeepSpeed's JIT ops in the job's parent, before its memory sampler starts: left to the first worker, the
compile (~1 GiB per file) landed in its memory and start-up (a sweep's first job looked 5x costlier). A cold build
waits for the workers at the gate (job/gate.py). `python -m zerotune.host.ops`: build the CPU ops (shm comm, CPU
Adam) into the torch extensions cache now, as `make setup` does."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from zerotune.config.errors import ConfigError
from zerotune.host import ops_locks
from zerotune.host.memory import MemorySampler
from zerotune.host.ops_env import KEY, link_torch_lib, remember_cpu_info

log = logging.getLogger("zerotune")

# What DeepSpeed 0.19's engine loads for each optimizer (engine._configure_basic_optimizer /
# get_optimizer_configuration): a CPU kernel when the optimizer is offloaded (cpu or nvme), else a fused one.
OFFLOADED = {"adam": "CPUAdamBuilder", "adamw": "CPUAdamBuilder", "adagrad": "CPUAdagradBuilder",
             "lion": "CPULionBuilder"}
ON_DEVICE = {"adam": "FusedAdamBuilder", "adamw": "FusedAdamBuilder", "lamb": "FusedLambBuilder",
             "lion": "FusedLionBuilder"}
# comm/torch.py build_shm_op(): every TorchBackend (gloo, on the CPU accelerator) loads it. Loading only registers
# kernels (initialize(), in the workers, sets up its shared memory), so loading it in the parent is harmless.
SHM_COMM = "ShareMemCommBuilder"

COMPILER_FIX = ("install a C++ compiler and ninja (apt-get install g++ ninja-build, or pip install ninja) and "
                "make the torch extensions cache (TORCH_EXTENSIONS_DIR) writable")
FIXES = {  # builder -> (config key, fix): the worker would fail on the same op the same way
    "AsyncIOBuilder": ("offload.device", "install libaio (apt-get install libaio-dev, yum install libaio-devel) "
                                         f"or use offload=cpu; also {COMPILER_FIX}"),
    "PinMemoryBuilder": ("offload.device", f"{COMPILER_FIX}, or use offload=cpu"),
    SHM_COMM: ("deepspeed.enabled", f"{COMPILER_FIX}, or run without DeepSpeed (zero_stage=0 "
                                    "deepspeed.enabled=false)"),
}


# A lock held by a live process is another job's build (or load) of the same op: worth waiting for, as long as
# a cold build takes on a slow machine (cpu_adam: about 3 minutes on 2 cores), and no longer.
LOCK_WAIT_ENV, LOCK_WAIT_S = "ZEROTUNE_OP_LOCK_WAIT_S", 900.0


class OpBuildError(ConfigError):
    """DeepSpeed could not build an op this run needs; a ConfigError so that a sweep records it and goes on."""


def needed_ops(ds_config: dict, use_deepspeed: bool) -> list[str]:
    """The DeepSpeed op builders (class names) the workers will load for this DeepSpeed dict, in load order."""
    if not use_deepspeed:
        return []  # plain accelerate: torch's own optimizers, no DeepSpeed op
    zero = ds_config.get("zero_optimization") or {}
    devices = {(zero.get(block) or {}).get("device", "none") for block in ("offload_optimizer", "offload_param")}
    offloaded = str((zero.get("offload_optimizer") or {}).get("device", "none")) in ("cpu", "nvme")
    ops = [SHM_COMM]  # first: init_distributed loads it before the engine is built
    ops += _optimizer_ops(ds_config.get("optimizer"), offloaded)
    if "nvme" in devices:
        ops += ["PinMemoryBuilder", "AsyncIOBuilder"]  # async_io's load() loads pin_memory first
    elif os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() == "native":
        ops.append("PinMemoryBuilder")  # utils/pin_memory.py: native pinning through the pin_memory op
    return ops


def _optimizer_ops(block: Any, offloaded: bool) -> list[str]:
    if not isinstance(block, dict):
        return []  # no optimizer block: the model code's own (torch) optimizer
    name = str(block.get("type", "")).lower()  # DeepSpeed matches optimizer names case-insensitively
    params = block.get("params") or {}
    if name in ("adam", "adamw") and params.get("torch_adam"):
        return []  # torch.optim.AdamW, whatever the offload
    builder = (OFFLOADED if offloaded else ON_DEVICE).get(name)
    return [builder] if builder else []


def prebuild_ops(ds_config: dict, use_deepspeed: bool, before_compiling: Callable[[], Any] | None = None) -> dict:
    """Build (or load from the cache) every op the workers will load; the record for summary.json.
    `before_compiling` is called once, before the first op that is not in the cache is compiled."""
    names = needed_ops(ds_config, use_deepspeed)
    record: dict = {"ops": [], "skipped": [], "total_seconds": 0.0, "host_peak_mib": None}
    if not names:
        return record
    from deepspeed.accelerator import get_accelerator  # the parent imported DeepSpeed already (preflight)

    link_torch_lib()  # torch under a path with a space: its builds link through a link to its libraries
    remember_cpu_info()  # DeepSpeed's builders ask py-cpuinfo at each op: a new interpreter each time
    accelerator = get_accelerator()
    start = time.perf_counter()
    for name in names:
        builder = _builder(accelerator, name)
        if builder is None:
            record["skipped"].append(name)  # the workers skip it too (shm) or preflight refused the run
            continue
        clear_lock(builder.name)
        if before_compiling is not None and not is_cached(builder.name):
            before_compiling()
            before_compiling = None
        one = _build_isolated(name) if _needs_device(builder, accelerator) else _build_here(name, builder)
        log.info("DeepSpeed op %s: %s in %.1f s, host peak %.0f MiB", one["name"],
                 "loaded from the cache" if one["was_cached"] else "built", one["seconds"], one["host_peak_mib"])
        record["ops"].append(one)
    record["total_seconds"] = time.perf_counter() - start
    peaks = [op["host_peak_mib"] for op in record["ops"] if op["host_peak_mib"] is not None]
    record["host_peak_mib"] = max(peaks, default=None)
    return record


def is_cached(op: str) -> bool:
    """Whether the op's library is in the torch extensions cache (a stale one is rebuilt anyway)."""
    return ops_locks.lock_path(op).with_name(f"{op}.so").exists()


def clear_lock(op: str) -> None:
    """torch's loader waits with no limit while <extensions root>/<op>/lock exists: remove it when provably
    stale, wait a bounded time while a live process holds it, else stop here naming the file."""
    wait_s = float(os.environ.get(LOCK_WAIT_ENV, LOCK_WAIT_S))
    state = ops_locks.settle(ops_locks.lock_path(op), wait_s)
    if state.state == "held":
        pids = " ".join(map(str, state.pids)) or "<pid>"
        raise OpBuildError(KEY, f"{state.describe()}; it was still held after {wait_s:.0f} s",
                           f"let that build finish and start again; if it is stuck, stop it (kill {pids}) and its "
                           f"lock is removed at the next start; or wait longer ({LOCK_WAIT_ENV}=<seconds>), or "
                           f"give this job its own cache ({KEY}=<another folder>)")
    if state.state == "undecided":
        raise OpBuildError(KEY, state.describe(),
                           f"it is safe to delete when no DeepSpeed op build is running: rm {state.path}")


def _builder(accelerator: Any, name: str) -> Any | None:
    """The accelerator's builder for `name`, or None where the workers would not load it."""
    builder = accelerator.create_op_builder(name)
    if builder is None or type(builder).__name__ == "NotImplementedBuilder":
        return None
    if name == SHM_COMM:
        from deepspeed.ops.op_builder.builder import probe_is_compatible

        # build_shm_op() loads it only where it is compatible (Linux); elsewhere DeepSpeed uses plain gloo.
        if not probe_is_compatible(builder):
            return None
    return builder


def _needs_device(builder: Any, accelerator: Any) -> bool:
    """Whether the build needs the GPU: a CUDA op's JIT build asks torch.cuda for the architectures, which would
    leave a CUDA context in this process for the whole job."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    return accelerator.device_name() != "cpu" and isinstance(builder, CUDAOpBuilder)


def _build_here(name: str, builder: Any) -> dict:
    """Load one op in this process, sampling this process and its compiler children."""
    with MemorySampler(include_root=True) as sampler:
        result = load_op(name, builder)
    return {**result, "host_peak_mib": sampler.peaks()["host_peak_rss_mib"]}


def load_op(name: str, builder: Any) -> dict:
    """builder.load(), as DeepSpeed's optimizers and swappers call it; timed, with where the op lives."""
    start_wall, start = time.time(), time.perf_counter()
    try:
        module = builder.load()
    except Exception as exc:
        raise _build_error(name, builder.NAME, exc) from exc
    seconds = time.perf_counter() - start
    path = getattr(module, "__file__", None)
    # Built now: its .so was (re)written during this call; loaded from the cache: it is older than the call.
    cached = bool(path and os.path.getmtime(path) < start_wall)
    return {"name": builder.NAME, "builder": name, "seconds": seconds, "was_cached": cached, "path": path}


def _build_error(name: str, op: str, exc: BaseException) -> OpBuildError:
    key, fix = FIXES.get(name, ("offload.device", f"{COMPILER_FIX}, or choose an optimizer / offload that does "
                                                  "not need it (offload=none)"))
    cause = " | ".join(str(exc).strip().splitlines()[-6:])[-1500:]  # the compiler's last words
    return OpBuildError(key, f"DeepSpeed could not build its {op} op, which this run loads ({cause})", fix)


def _build_isolated(name: str) -> dict:
    """Build one op in a spawned child process (its own interpreter: no CUDA state shared with the parent)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_build, args=(name, send), name=f"zerotune-build-{name}")
    child.start()
    send.close()
    with MemorySampler(pid=child.pid, include_root=True) as sampler:
        try:
            outcome = receive.recv()
        except EOFError:  # it died without a word (killed, out of memory)
            child.join()
            outcome = {"error": f"the build process died (exit code {child.exitcode})"}
        child.join()
    if "error" in outcome:
        raise _build_error(name, outcome.get("op", name), RuntimeError(outcome["error"]))
    return {**outcome, "host_peak_mib": sampler.peaks()["host_peak_rss_mib"]}


def _child_build(name: str, send: Any) -> None:
    """In the spawned child: load the op and send back the record, or the error."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(name)
    try:
        link_torch_lib()  # a process of its own: torch's module state is not the parent's
        remember_cpu_info()
        send.send(load_op(name, builder))
    except ConfigError as exc:
        send.send({"error": str(exc.__cause__ or exc), "op": builder.NAME})
    finally:
        send.close()


OFFLOAD_CPU = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
               "optimizer": {"type": "AdamW", "params": {}}}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        record = prebuild_ops(OFFLOAD_CPU, use_deepspeed=True)
    except Exception as exc:  # noqa: BLE001  (a job builds them again at its start, and says why it could not)
        print(f"zerotune.host: DeepSpeed's CPU ops did not build: {exc}", file=sys.stderr)
        return 1
    print(f"zerotune.host: {', '.join(op['name'] for op in record['ops'])} ready in {record['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long does the planner's fake-tensor trace take, and how close is it to a real step?

Prints (1) the time of one trace of SDXL's U-Net (model=sdxl) at 1024 px (latent 4x128x128), batch 8,
bf16, gradient checkpointing: cold (an empty cache folder), then from this process's cache and from the
disk cache (target: cold <= 60 s on 2 cores); (2) the 12 accuracy cases of tests/test_plan_activations.py
as a table: the traced activation peak against the same step run for real on this CPU (fp32, batch 2),
between ops (what the trace measures; the test's criterion, 0.9-1.1) and with the CPU kernels' scratch
buffers (informational).

`--adapter lora` traces and runs every step with the LoRA adapter (conf/adapter/lora.yaml, the model's
`lora_targets`): the base U-Net frozen, the adapter's branches added.

    python benchmarks/bench_plan_trace.py [--skip-sdxl] [--skip-accuracy] [--adapter lora]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from zerotune.config.compose import compose
from zerotune.config.compose.settle import settle
from zerotune.models import latent_shape

CASES = [(model, size, checkpointing) for model, sizes in (("tiny", (8, 16, 32)), ("sdxl_tiny", (64, 128, 256)))
         for size in sizes for checkpointing in (False, True)]


def model_cfg(name: str, size: int | None = None, adapter: str = "none"):
    """The model's config and the adapter's, as the job settles them (interpolations resolved against the whole
    config)."""
    overrides = [f"model={name}", "data=synthetic", f"adapter={adapter}"] + ([f"resolution={size}"] if size else [])
    cfg = settle(compose(overrides), overrides).config
    return cfg.model, cfg.adapter


def bench_sdxl(adapter: str) -> None:
    from zerotune.plan import activations

    cfg, tuned = model_cfg("sdxl", 1024, adapter)
    args = (cfg, latent_shape(cfg, 1024), 8, "bf16", True, str(cfg.attention), tuned)
    timings = {}
    for label in ("cold", "cached in process", "cached on disk"):
        if label == "cached on disk":
            activations._TRACES.clear()
        start = time.perf_counter()
        trace = activations.trace_step(*args)
        timings[label] = time.perf_counter() - start
    print(f"SDXL 1024 px, batch 8, bf16, gradient checkpointing ({trace.key})")
    for label, seconds in timings.items():
        print(f"  {label:18s} {seconds * 1e3:10.1f} ms")
    print(f"  activation peak {trace.activation_peak_bytes / 2**30:.2f} GiB, parameters "
          f"{trace.param_bytes / 2**30:.2f} GiB, gradients {trace.grad_bytes / 2**30:.2f} GiB, "
          f"forward {trace.forward_flops / 1e12:.1f} TFLOP, backward {trace.backward_flops / 1e12:.1f} TFLOP")


def bench_accuracy(adapter: str) -> None:
    from zerotune.plan.activations import measure_step_on_cpu, trace_step

    print(f"\n{'model':10s} {'px':>4s} {'latent':>9s} {'ckpt':>4s} {'traced B':>13s} {'real B':>13s} "
          f"{'ratio':>6s} {'real+ws B':>13s} {'ratio':>6s}")
    for name, size, checkpointing in CASES:
        cfg, tuned = model_cfg(name, adapter=adapter)
        shape = latent_shape(cfg, size)
        traced = trace_step(cfg, shape, 2, "fp32", checkpointing, str(cfg.attention), tuned).activation_peak_bytes
        real = measure_step_on_cpu(cfg, shape, 2, checkpointing, str(cfg.attention), adapter_cfg=tuned)
        print(f"{name:10s} {size:4d} {'x'.join(map(str, shape)):>9s} {'yes' if checkpointing else 'no':>4s} "
              f"{traced:13,d} {real.between_ops:13,d} {traced / real.between_ops:6.3f} "
              f"{real.with_workspaces:13,d} {traced / real.with_workspaces:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-sdxl", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--adapter", default="none", help="none (full training) or lora")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["ZEROTUNE_CACHE_DIR"] = cache  # cold: nothing traced before
        if not opts.skip_sdxl:
            bench_sdxl(opts.adapter)
        if not opts.skip_accuracy:
            bench_accuracy(opts.adapter)


if __name__ == "__main__":
    main()

"""Baseline 2: the diffusers-example loop, Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)),
given a zerotune job's work.

    python benchmarks/baselines/accelerate_loop.py <zerotune run dir> [--steps N]
    torchrun --standalone --nproc_per_node 2 benchmarks/baselines/accelerate_loop.py <run dir>

Rank 0 prints one JSON line (first loss, step-time median, when the first step ended).
"""

from __future__ import annotations

import math

from common import Clock, build_work, load_job, lone_process_env, loss_of, parse_args, rank_and_world, report


def main() -> None:
    args = parse_args(__doc__)
    lone_process_env()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    cfg, ds = load_job(args.run_dir)
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "no"
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds), mixed_precision=precision)
    unet, loader, schedule, generator = build_work(cfg, ds["train_micro_batch_size_per_gpu"])
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = DummyOptim(params, lr=ds["optimizer"]["params"]["lr"])
    scheduler = DummyScheduler(optimizer) if "scheduler" in ds else None
    if scheduler is None:
        unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    else:
        unet, optimizer, loader, scheduler = accelerator.prepare(unet, optimizer, loader, scheduler)
    rank, world = rank_and_world()
    clip = float(ds.get("gradient_clipping", 0.0)) or math.inf
    clock, first_loss, step = Clock(accelerator.device), None, 0
    while step < args.steps:
        for batch in loader:
            clock.start()
            with accelerator.accumulate(unet):
                loss = loss_of(unet, batch, cfg, schedule, generator, rank, world)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), clip)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            value = float(loss.detach())
            clock.stop()
            first_loss = value if first_loss is None else first_loss
            step += 1
            if step == args.steps:
                break
    report(clock, first_loss, step, rank)


if __name__ == "__main__":
    main()

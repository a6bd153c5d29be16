"""Baseline 1: the loop a user writes by hand with deepspeed.initialize, given a zerotune job's work.

    python benchmarks/baselines/raw_deepspeed_loop.py <zerotune run dir> [--steps N]
    torchrun --standalone --nproc_per_node 2 benchmarks/baselines/raw_deepspeed_loop.py <run dir>

Rank 0 prints one JSON line (first loss, step-time median, when the first step ended).
"""

from __future__ import annotations

from common import Clock, build_work, load_job, lone_process_env, loss_of, parse_args, rank_and_world, report


def main() -> None:
    args = parse_args(__doc__)
    lone_process_env()
    import deepspeed

    rank, world = rank_and_world()
    cfg, ds = load_job(args.run_dir)
    deepspeed.init_distributed(dist_backend="gloo" if deepspeed.get_accelerator().device_name() == "cpu" else None)
    unet, loader, schedule, generator = build_work(cfg, ds["train_micro_batch_size_per_gpu"])
    engine, _, _, _ = deepspeed.initialize(model=unet, config=ds,
                                           model_parameters=[p for p in unet.parameters() if p.requires_grad])
    clock, first_loss, step = Clock(engine.device), None, 0
    while step < args.steps:
        for i, batch in enumerate(loader):
            if i % world != rank:
                continue  # each rank its own batches, round robin (what accelerate's shards do)
            clock.start()
            loss = loss_of(engine, batch, cfg, schedule, generator, rank, world)
            engine.backward(loss)
            engine.step()  # clipping, optimizer, scheduler and zero_grad, as the ds_config says
            value = float(loss.detach())
            clock.stop()
            first_loss = value if first_loss is None else first_loss
            step += 1
            if step == args.steps:
                break
    report(clock, first_loss, step, rank)


if __name__ == "__main__":
    main()

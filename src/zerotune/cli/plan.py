"""Will it fit? The planner's command: predicted GPU, host and NVMe peak and the time floor per step,
before any GPU is rented or any job launched.

    zerotune plan model=sdxl resolution=1024 train.batch_size=8 --gpu rtx4090
    zerotune plan model=sdxl resolution=1024 train.batch_size=8 --gpu rtx4090 --all
    zerotune plan zero_stage=3 offload=cpu --gpu-mib 12288 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

from zerotune import config_search
from zerotune.cli.compose import compose
from zerotune.errors import ConfigError, report_config_error
from zerotune.plan import gpus, recommend, render
from zerotune.plan.predict import predict
from zerotune.platform import ANY_CUDA_GPU, Platform
from zerotune.preflight import preflight

# What --all varies: ZeRO stage x offload x gradient checkpointing (NVMe offload is ZeRO-3's only).
OPTIONS = [(stage, offload, checkpointing) for stage in (0, 1, 2, 3) for offload in ("none", "cpu", "nvme")
           for checkpointing in (False, True) if offload != "nvme" or stage == 3]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotune plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default=None, help=f"the card: {', '.join(gpus.CATALOG)}")
    parser.add_argument("--gpu-mib", type=int, default=None, help="or its memory in MiB")
    parser.add_argument("--all", action="store_true", help="rank every zero_stage x offload x checkpointing")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: a card's memory (default); cpu: the step as it runs on this machine's CPU")
    config_search.add_config_dir_option(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for zerotune train")
    return parser


_NO_LOCK = contextlib.nullcontext()  # reusable: it holds nothing


def plan_one(overrides: list[str], gpu: gpus.GPU | None,
             trace_lock: AbstractContextManager = _NO_LOCK, device: str = "cuda") -> dict:
    """One job's prediction. `trace_lock` is held while it traces (the builder page's requests take turns).
    `device` cpu: the job as it runs on this machine's CPU accelerator (its own dict: torch's AdamW, no card)."""
    cfg = compose(overrides)
    gpu = None if device == "cpu" else gpu or gpus.lookup(cfg.plan.gpu, cfg.plan.gpu_mib)
    checked = preflight(cfg, overrides=overrides, platform=platform_for(gpu))
    with trace_lock:
        return predict(cfg, checked, gpu, device=device)


def platform_for(gpu: gpus.GPU | None) -> Platform | None:
    """A plan for a named card is checked as a config for a CUDA card (Lion without offload needs its fused
    kernel, which this CPU machine lacks and the card has); with no card named, against this machine."""
    return ANY_CUDA_GPU if gpu is not None else None


def plan_all(overrides: list[str], gpu: gpus.GPU | None, plan: Callable[[list[str], gpus.GPU | None], dict] = plan_one
             ) -> dict:
    """Every option in OPTIONS ranked; `plan` predicts one job (the builder page's takes its locks)."""
    rows = []
    for stage, offload, checkpointing in OPTIONS:
        option = [f"zero_stage={stage}", f"offload={offload}", f"train.gradient_checkpointing={checkpointing}"]
        try:
            rows.append(recommend.Row(stage, offload, checkpointing, plan([*overrides, *option], gpu)))
        except ConfigError as exc:
            rows.append(recommend.Row(stage, offload, checkpointing, None, refused=str(exc).splitlines()[0]))
    return recommend.rank(rows, gpu)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.device == "cpu" and (args.all or args.gpu or args.gpu_mib is not None):
        parser.error("--device cpu predicts this machine's CPU run: leave out --all, --gpu and --gpu-mib")
    try:
        config_search.choose_and_warn(args.config_dir)
        gpu = gpus.lookup(args.gpu, args.gpu_mib, key="--gpu") if args.gpu or args.gpu_mib is not None else None
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep it for the answer
            answer = plan_all(args.overrides, gpu) if args.all else plan_one(args.overrides, gpu, device=args.device)
    except ConfigError as exc:
        return report_config_error(exc)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(render.ranking(answer) if args.all else render.breakdown(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

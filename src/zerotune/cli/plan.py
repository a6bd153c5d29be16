"""Will it fit? The planner's command: predicted GPU, host and NVMe peak and the time floor per step,
before any GPU is rented or any job launched.

    zerotune plan model=sdxl resolution=1024 train.batch_size=8 --gpu rtx4090
    zerotune plan model=sdxl resolution=1024 train.batch_size=8 --gpu rtx4090 --all
    zerotune plan zero_stage=3 offload=cpu --gpu-mib 12288 --json"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from zerotune.config import search
from zerotune.config.errors import ConfigError, report_config_error
from zerotune.plan import command_line, gpus
from zerotune.plan.command_line import plan_all, plan_one
from zerotune.rundir.plan import Plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotune plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default=None, help=f"the card: {', '.join(gpus.CATALOG)}")
    parser.add_argument("--gpu-mib", type=int, default=None, help="or its memory in MiB")
    parser.add_argument("--all", action="store_true", help="rank every zero_stage x offload x checkpointing")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: a card's memory (default); cpu: the step as it runs on this machine's CPU")
    search.add_config_dir_option(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for zerotune train")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.device == "cpu" and (args.all or args.gpu or args.gpu_mib is not None):
        parser.error("--device cpu predicts this machine's CPU run: leave out --all, --gpu and --gpu-mib")
    try:
        search.choose_and_warn(args.config_dir)
        gpu = gpus.lookup(args.gpu, args.gpu_mib, key="--gpu") if args.gpu or args.gpu_mib is not None else None
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep it for the answer
            answer = plan_all(args.overrides, gpu) if args.all else plan_one(args.overrides, gpu, device=args.device)
    except ConfigError as exc:
        return report_config_error(exc)
    if isinstance(answer, Plan):
        print(json.dumps(answer.to_dict(), indent=2) if args.json else command_line.breakdown(answer))
    else:
        print(json.dumps(answer, indent=2) if args.json else command_line.ranking(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

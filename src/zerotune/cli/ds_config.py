"""Print the validated DeepSpeed JSON for any composition, without training.

    zerotune ds-config zero_stage=3 offload=nvme offload.path=/tmp/x
    zerotune ds-config --world-size 8 zero_stage=2 offload=cpu train.batch_size=4"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from zerotune.config import search
from zerotune.config.compose import compose_settled
from zerotune.config.errors import ConfigError, report_config_error
from zerotune.plan.resolve import check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerotune ds-config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes the run would use (default: launch.num_processes x launch.nnodes)")
    search.add_config_dir_option(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for zerotune train")
    args = parser.parse_intermixed_args(argv)
    # DeepSpeed logs to stdout; keep stdout for the JSON alone, so it can be piped to a file.
    try:
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError("--world-size", f"must be 1 or more, got {args.world_size}", "--world-size 8")
        search.choose_and_warn(args.config_dir)
        settled = compose_settled(args.overrides, world_size=args.world_size)
        with contextlib.redirect_stdout(sys.stderr):
            resolved = check(settled)
    except ConfigError as exc:
        return report_config_error(exc)
    print(json.dumps(resolved.ds_config, indent=2))
    print_sources(resolved.config_sources)
    return 0


def print_sources(sources: dict) -> None:
    """Where each top-level value came from, on stderr (stdout stays the JSON alone)."""
    lines = ["where each top-level value came from:"]
    width = max(len(k) for k in sources["values"])
    lines += [f"  {key:<{width}}  {origin}" for key, origin in sources["values"].items()]
    user = (sources.get("configs") or {}).get("user_folder")
    if user:
        lines.append(f"your configs: {user['path']} ({user['how']}), searched before the packaged ones")
    for acc in sources["accelerate_config"]:
        lines.append(f"accelerate config: {acc['path'] or acc['origin']} ({acc['how']})")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

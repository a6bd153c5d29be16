"""Check what DeepSpeed training needs on this machine, one line per check, each problem with its fix:

    zerotune doctor
    zerotune doctor --offload-path /mnt/nvme/zerotune --json
    zerotune doctor zero_stage=3 offload=nvme offload.path=/mnt/nvme/zerotune

Exit code 0 when nothing failed, 1 when a check failed, 2 for a config error in the overrides.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from zerotune import config_search
from zerotune.compose import compose
from zerotune.compose.node import to_config
from zerotune.doctor.check import as_json, as_text, exit_code
from zerotune.doctor.run import configured_offload_path, run_checks
from zerotune.errors import ConfigError, report_config_error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotune doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--offload-path", default=None, help="the NVMe offload folder to check (default: the "
                        "composed config's offload.path)")
    parser.add_argument("--fix", action="store_true", help="remove torch extensions locks that are provably stale")
    config_search.add_config_dir_option(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for zerotune train")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        config_search.choose_and_warn(args.config_dir)
        cfg = to_config(compose(args.overrides))  # as composed: the user's files are checked, not applied
        offload_path = args.offload_path or configured_offload_path(cfg)
    except ConfigError as exc:
        return report_config_error(exc)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep it for the report
        checks = run_checks(cfg, args.overrides, offload_path, args.fix)
    print(as_json(checks) if args.json else as_text(checks))
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())

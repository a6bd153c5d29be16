"""`zerotune import-config FILE [--save NAME]` (and `python -m zerotune import-config`): the command; the work
is zerotune/import_config/."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from zerotune.config import compose, search
from zerotune.config.errors import CONFIG_ERROR_EXIT, ConfigError, report_config_error
from zerotune.plan import import_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerotune import-config", description=import_config.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path, help="an accelerate config YAML or a DeepSpeed JSON")
    parser.add_argument("--save", metavar="NAME", help="also write ./zerotune/experiment/NAME.yaml "
                        "(in --config-dir's folder, when given), which `zerotune train experiment=NAME` runs")
    parser.add_argument("--force", action="store_true", help="overwrite an existing experiment file")
    search.add_config_dir_option(parser)
    args = parser.parse_args(argv)
    try:
        search.choose_and_warn(args.config_dir)
        target = compose.experiment_path(args.save, key="--save") if args.save else None
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; stdout is the answer
            overrides, differ = import_config.overrides_for(args.file)
    except ConfigError as exc:
        return report_config_error(exc)
    print(" ".join(overrides))
    if differ:
        print(f"# kept as deepspeed.config_file for: {', '.join(differ)}", file=sys.stderr)
    if target is not None:
        if target.exists() and not args.force:
            print(f"zerotune: {target} exists; choose another name or add --force", file=sys.stderr)
            return CONFIG_ERROR_EXIT
        compose.write_experiment(target, import_config.experiment_yaml(args.file, overrides, differ))
        print(f"wrote {target}: zerotune train experiment={args.save}", file=sys.stderr)
    return 0

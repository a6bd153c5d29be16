"""`zerotune doctor`: what a DeepSpeed setup needs, checked on this machine, each problem with its fix.

Every check `zerotune doctor` runs (zerotune/cli/doctor.py), each guarded: one that breaks is reported as
such and the others still run.

Check what DeepSpeed training needs on this machine, one line per check, each problem with its fix:

    zerotune doctor
    zerotune doctor --offload-path /mnt/nvme/zerotune --json
    zerotune doctor zero_stage=3 offload=nvme offload.path=/mnt/nvme/zerotune

Exit code 0 when nothing failed, 1 when a check failed, 2 for a config error in the overrides."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

from zerotune.cli import doctor_checks
from zerotune.cli.doctor_checks import FAIL, Check, as_json, as_text, exit_code
from zerotune.config import search
from zerotune.config.compose import compose
from zerotune.config.compose.settle import to_config
from zerotune.config.errors import ConfigError, report_config_error
from zerotune.config.schema import Config


def run_checks(cfg: Config, overrides: list[str], offload_path: str | None, fix: bool) -> list[Check]:
    nvme_wanted = cfg.offload.device == "nvme"
    checks = [_guarded("configs", doctor_checks.configs_check), _guarded("platform", doctor_checks.platform_check)]
    table = _guarded_table()
    built = {n for n, op in table.items() if op["installed"] or op["cached"]}
    checks.append(_guarded("build tools", lambda: doctor_checks.build_tools_check(built)))
    checks.append(_guarded("ops", lambda: doctor_checks.ops_check(table)))
    checks.append(_guarded("libaio", lambda: doctor_checks.libaio_check(table, nvme_wanted)))
    checks.append(_guarded("offload path", lambda: doctor_checks.offload_path_check(offload_path, cfg, overrides)))
    checks.append(_guarded("locks", lambda: doctor_checks.locks_check(remove=fix)))
    checks.append(_guarded("gpus", doctor_checks.gpus_check))
    checks.append(_guarded("accelerate", doctor_checks.accelerate_check))
    return checks


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """One check that breaks is reported as such; the others still run."""
    try:
        return check()
    except Exception as exc:
        return Check(name, FAIL, f"the check could not run: {type(exc).__name__}: {exc}".replace("\n", " "),
                     "run `ds_report` for DeepSpeed's own view of this machine")


def _guarded_table() -> dict[str, dict]:
    try:
        return doctor_checks.op_table()
    except Exception:
        return {}  # no DeepSpeed: the platform check says so


def configured_offload_path(cfg: Config) -> str | None:
    return None if cfg.offload.path is None else str(cfg.offload.path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotune doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--offload-path", default=None, help="the NVMe offload folder to check (default: the "
                        "composed config's offload.path)")
    parser.add_argument("--fix", action="store_true", help="remove torch extensions locks that are provably stale")
    search.add_config_dir_option(parser)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for zerotune train")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        search.choose_and_warn(args.config_dir)
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

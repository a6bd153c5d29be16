"""Every check `zerotune doctor` runs (zerotune/cli/doctor.py), each guarded: one that breaks is reported as
such and the others still run."""

from __future__ import annotations

from collections.abc import Callable

from zerotune.doctor import files, system
from zerotune.doctor.check import FAIL, Check
from zerotune.schema import Config


def run_checks(cfg: Config, overrides: list[str], offload_path: str | None, fix: bool) -> list[Check]:
    nvme_wanted = cfg.offload.device == "nvme"
    checks = [_guarded("configs", files.configs_check), _guarded("platform", system.platform_check)]
    table = _guarded_table()
    built = {n for n, op in table.items() if op["installed"] or op["cached"]}
    checks.append(_guarded("build tools", lambda: system.build_tools_check(built)))
    checks.append(_guarded("ops", lambda: system.ops_check(table)))
    checks.append(_guarded("libaio", lambda: system.libaio_check(table, nvme_wanted)))
    checks.append(_guarded("offload path", lambda: files.offload_path_check(offload_path, cfg, overrides)))
    checks.append(_guarded("locks", lambda: files.locks_check(remove=fix)))
    checks.append(_guarded("gpus", system.gpus_check))
    checks.append(_guarded("accelerate", files.accelerate_check))
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
        return system.op_table()
    except Exception:
        return {}  # no DeepSpeed: the platform check says so


def configured_offload_path(cfg: Config) -> str | None:
    return None if cfg.offload.path is None else str(cfg.offload.path)

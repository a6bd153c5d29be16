"""The `train.py` command: normalise argv, compose with Hydra, train, report."""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from zerotune import CONF_DIR
from zerotune.cli.overrides import normalize_overrides
from zerotune.errors import CONFIG_ERROR_EXIT, ConfigError

log = logging.getLogger("zerotune")


def _fail(exc: ConfigError) -> None:
    print(f"zerotune: config error at {exc}", file=sys.stderr)
    sys.exit(CONFIG_ERROR_EXIT)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from zerotune.training.run import print_result, train

    try:
        summary = train(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as exc:
        _fail(exc)
    print_result(summary)


def main() -> None:
    # Hydra options (--cfg job, -m, --help) pass through untouched; only key=value overrides are rewritten.
    try:
        sys.argv[1:] = normalize_overrides(sys.argv[1:], CONF_DIR)
    except ConfigError as exc:
        _fail(exc)
    _hydra_main()

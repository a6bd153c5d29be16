"""zerotune: Hydra-composed DeepSpeed ZeRO experiments for diffusion U-Nets."""

from pathlib import Path

__version__ = "0.1.0"

# The Hydra config tree ships beside the package source in a checkout (conf/ at the top level).
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

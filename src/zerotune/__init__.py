"""zerotune: Hydra-composed DeepSpeed ZeRO experiments for diffusion U-Nets."""

__version__ = "0.1.0"

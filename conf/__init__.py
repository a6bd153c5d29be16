"""zerotune's packaged configs: Hydra reads this folder as pkg://zerotune.config.conf (src/zerotune/config/conf links here)."""

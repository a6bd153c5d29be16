"""zerotune's packaged configs: Hydra reads this folder as pkg://zerotune.conf (src/zerotune/conf links here)."""

"""zerotune: train a diffusion U-Net under DeepSpeed ZeRO, configured by Hydra (see README.md)."""

from zerotune.cli.main import main

if __name__ == "__main__":
    main()

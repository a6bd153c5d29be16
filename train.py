"""zerotune: train a diffusion U-Net under DeepSpeed ZeRO, configured by Hydra (see README.md)."""

from zerotune.held_signals import hold

hold()  # first: a stop signal during the imports below (`srun python train.py` on a busy cluster) is the job's

from zerotune.cli.main import main  # noqa: E402 (after hold)

if __name__ == "__main__":
    main()

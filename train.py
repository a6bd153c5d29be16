"""zerotune: train a diffusion U-Net under DeepSpeed ZeRO, configured by Hydra (see README.md)."""

from zerotune.host.process import hold

hold()  # first: a stop signal during the imports below (`srun python train.py` on a busy cluster) is the job's

from zerotune.cli.train import main  # noqa: E402 (after hold)

if __name__ == "__main__":
    main()

"""`zerotune <command> ...`: one command for everything zerotune does.

    zerotune train train.max_steps=3               # as `python train.py ...`: Hydra overrides, -m, --cfg job
    zerotune tune model=sdxl_tiny data=synthetic resolution=64 hydra.sweeper.global_batch=32
    zerotune plan model=sdxl resolution=1024 --gpu rtx4090
    zerotune ds-config zero_stage=3 offload=cpu
    zerotune doctor

`python -m zerotune <command> ...` is the same (and in a checkout, `python train.py ...` is `zerotune train`).
Your own configs and experiments go in ./zerotune/ (or `--config-dir DIR`), searched before the packaged ones.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    summary: str


# Imported only when run: `zerotune train` must not wait for the builder's web server, nor `zerotune report`
# for torch.
COMMANDS = {
    "train": Command("zerotune.cli.train", "train, or sweep with -m (Hydra overrides; --help lists the groups)"),
    "tune": Command("zerotune.cli.train", "find the fastest configuration that fits: short measured trials (-m hydra/sweeper=tune)"),
    "plan": Command("zerotune.cli.plan", "predict GPU and host memory for a configuration, without training"),
    "ds-config": Command("zerotune.cli.ds_config", "print the DeepSpeed config a configuration composes to"),
    "import-config": Command("zerotune.cli.import_config", "turn an accelerate YAML or DeepSpeed JSON into overrides"),
    "export": Command("zerotune.cli.export", "write a checkpoint's U-Net (or LoRA adapter) as diffusers files"),
    "report": Command("zerotune.cli.report", "summarise sweeps: tables, plots, the fastest that fits"),
    "doctor": Command("zerotune.cli.doctor", "check this machine for DeepSpeed training, and where configs come from"),
    "builder": Command("zerotune.cli.builder", "serve the config builder page on this machine"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "usage: zerotune <command> [args...]\n\ncommands:\n" + "\n".join(lines) + "\n\n" + \
        "`zerotune <command> --help` for a command's own options.\n"


def tune_arguments(rest: list[str]) -> list[str]:
    """`zerotune tune ...` is `zerotune train -m hydra/sweeper=tune ...`; `--gpu NAME` is hydra.sweeper.gpu=NAME."""
    out, rest = ["-m", "hydra/sweeper=tune"], list(rest)
    while rest:
        arg = rest.pop(0)
        if arg == "--gpu" and rest:
            out.append(f"hydra.sweeper.gpu={rest.pop(0)}")
        elif arg.startswith("--gpu="):
            out.append(f"hydra.sweeper.gpu={arg.split('=', 1)[1]}")
        elif arg not in ("-m", "--multirun"):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__.strip() + "\n\n" + usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"zerotune: no command {name!r}\n  fix: one of: {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in ("train", "tune"):
        from zerotune.host.process import hold

        hold()  # before the imports: a stop signal during them (`srun zerotune train` under SLURM) is the job's
    else:  # train's and tune's are Hydra's (conf/hydra/default.yaml), with a run folder for their log
        from zerotune.config import files
        from zerotune.host import process

        process.command_logging(files.cache_dir("logs") / f"{name}.log")
    module = importlib.import_module(COMMANDS[name].module)
    if name in ("train", "tune"):
        # Hydra reads sys.argv itself, and shows argv[0] as the command in its --help.
        sys.argv = [f"zerotune {name}", *(tune_arguments(rest) if name == "tune" else rest)]
        module.main()  # ends the process (train's own exit code)
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())

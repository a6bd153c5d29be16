"""Configs users already have: a DeepSpeed JSON, an accelerate YAML, or `accelerate launch`'s environment.

The file is the user's intent; zerotune's config groups fill only what it leaves out. compose/settle.py reads
the sources (`accelerate_config`, `deepspeed_file`), turns them into zerotune settings (`settings`), applies them
to the composed config, refusing a value typed on the command line that contradicts them, and records what was
used and where every value came from (`precedence.UserConfig`).
"""

from zerotune.user_config.precedence import UserConfig

__all__ = ["UserConfig"]

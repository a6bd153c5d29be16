"""Configs users already have: a DeepSpeed JSON, an accelerate YAML, or `accelerate launch`'s environment.

The file is the user's intent; zerotune's config groups fill only what it leaves out. `resolve` reads the
sources, turns them into zerotune settings (`settings`), applies them to the composed config, refusing a
value typed on the command line that contradicts them (`precedence`), and returns what the DeepSpeed dict
builder needs: the user's DeepSpeed dict (legacy keys translated) and where every value came from.
"""

from zerotune.user_config.precedence import UserConfig, resolve

__all__ = ["UserConfig", "resolve"]

"""`python -m zerotune.ds_config`: the preview command lives in zerotune.cli.ds_config (this name is kept
because users type it; the layering contract in pyproject.toml lists this one entry-point import)."""

import sys

from zerotune.cli.ds_config import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m zerotune.plan`: the command lives in zerotune.cli.plan (this name is kept because users type
it; the layering contract in pyproject.toml lists this one entry-point import)."""

import sys

from zerotune.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())

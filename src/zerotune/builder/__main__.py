"""`python -m zerotune.builder`: the config builder page (zerotune/cli/builder.py)."""

import sys

from zerotune.cli.builder import main

if __name__ == "__main__":
    sys.exit(main())

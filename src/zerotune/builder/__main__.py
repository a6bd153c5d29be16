"""`python -m zerotune.builder`: the config builder page (zerotune.builder.server)."""

import sys

from zerotune.builder.server import main

if __name__ == "__main__":
    sys.exit(main())

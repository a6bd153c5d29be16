"""`python -m zerotune.export` is `zerotune export`."""

import sys

from zerotune.cli.export import main

if __name__ == "__main__":
    sys.exit(main())

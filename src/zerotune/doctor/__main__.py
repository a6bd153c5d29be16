"""`python -m zerotune.doctor` is `zerotune doctor`."""

import sys

from zerotune.cli.doctor import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m zerotune.doctor` is `zerotune doctor`."""

import sys

from zerotune.doctor.cli import main

if __name__ == "__main__":
    sys.exit(main())

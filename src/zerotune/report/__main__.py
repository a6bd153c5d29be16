"""`python -m zerotune.report` is `zerotune report` (zerotune/cli/report.py)."""

import sys

from zerotune.cli.report import main

if __name__ == "__main__":
    sys.exit(main())

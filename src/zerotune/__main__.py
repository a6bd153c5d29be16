"""`python -m zerotune <command> ...` is `zerotune <command> ...` (zerotune/cli/command.py)."""

import sys

from zerotune.cli.command import main

sys.exit(main())

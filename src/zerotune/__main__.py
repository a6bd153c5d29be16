"""`python -m zerotune <command> ...` is `zerotune <command> ...` (zerotune/command.py)."""

import sys

from zerotune.command import main

sys.exit(main())

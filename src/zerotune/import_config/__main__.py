"""`python -m zerotune.import_config` is `zerotune import-config`."""

import sys

from zerotune.cli.import_config import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m diffmon.export``: the command line (:mod:`diffmon.export.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

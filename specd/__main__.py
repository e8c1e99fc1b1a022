"""`python -m specd ...`: the same as the `specd` command."""

import sys

from specd.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m server [serve] [flags]`: the same as `tokenmill`."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())

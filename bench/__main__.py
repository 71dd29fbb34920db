"""`python -m bench ...`: the same as `tokenmill bench ...`."""

import sys

from bench.cli import main

sys.exit(main())

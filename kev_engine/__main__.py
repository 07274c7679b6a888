"""`python -m kev_engine ...` runs the `kev` command line."""

import sys

from .cli import main

sys.exit(main())

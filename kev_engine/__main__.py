"""`python -m kev_engine ...` runs the engine's own commands (`kev serve` is in the installed `kev` command)."""

import sys

from .tools.cli import main

sys.exit(main())

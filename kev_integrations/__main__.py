"""`python -m kev_integrations ...` runs the installed `kev` command (the engine's commands and `kev serve`)."""

import sys

from .cli import main

sys.exit(main())

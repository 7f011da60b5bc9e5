"""`python -m e2e.controlplane up|down|status|env`: see cli.py."""

import sys

from .cli import main

sys.exit(main())

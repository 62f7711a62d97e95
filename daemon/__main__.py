"""``python -m daemon`` is ``cuctxd``."""

import sys

from daemon.cli import main

sys.exit(main())

"""``python -m cuctxd.daemon`` is ``cuctxd``."""

import sys

from cuctxd.daemon.service.cli import main

sys.exit(main())

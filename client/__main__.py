"""``python -m cuctxd.client`` is ``cuctx``."""

import sys

from cuctxd.client.cli import main

sys.exit(main())

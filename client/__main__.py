"""``python -m cuctxd.client`` is ``cuctx``."""

import sys

from cuctxd.client.cli.commands import main

sys.exit(main())

"""``python -m client`` is ``cuctx``."""

import sys

from client.cli import main

sys.exit(main())

"""cuctxd, a CUDA context daemon: ``from cuctxd import Client`` (or ``AsyncClient`` for asyncio).

The repository's root is this package: ``cuctxd.protos`` (the wire protocol),
``cuctxd.daemon`` (the server) and ``cuctxd.client`` (the library and the
``cuctx`` CLI). The names below are the client library's public ones.
"""

from cuctxd.client import *  # noqa: F403  (the public names are the client's, listed in its __all__)
from cuctxd.client import __all__ as __all__
from cuctxd.protos.version import __version__ as __version__

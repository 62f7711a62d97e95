"""cuctxd, a CUDA context daemon: ``from cuctxd import Client`` (or ``AsyncClient`` for asyncio).

The repository's root is this package: ``cuctxd.protos`` (the wire protocol),
``cuctxd.daemon`` (the server) and ``cuctxd.client`` (the library and the
``cuctx`` CLI). The names below are the client library's public ones, imported on first use (PEP 562): the
daemon, whose modules are imported beneath this package, never loads the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cuctxd.protos.version import __version__ as __version__

if TYPE_CHECKING:
    from cuctxd.client import *  # noqa: F403  (the public names are the client's, listed in its __all__)
    from cuctxd.client import __all__ as __all__


def __getattr__(name: str) -> Any:
    """A public name of the client (or ``__all__``), importing :mod:`cuctxd.client` the first time one is asked."""
    import cuctxd.client as client

    if name == "__all__" or name in client.__all__:
        return getattr(client, name)
    raise AttributeError(f"module 'cuctxd' has no attribute {name!r}")


def __dir__() -> list[str]:
    import cuctxd.client as client

    return sorted({*globals(), *client.__all__})

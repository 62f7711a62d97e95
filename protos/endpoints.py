"""The default endpoint both sides agree on: a per-user ipc:// socket."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SOCKET_NAME = "cuctxd.sock"

#: Environment variable a client reads when no endpoint is passed.
ENDPOINT_ENV = "CUCTXD_ENDPOINT"


def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/cuctxd``, else ``<tmp>/cuctxd-<uid>``: only this user may enter it."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "cuctxd"
    return Path(tempfile.gettempdir()) / f"cuctxd-{os.getuid()}"


def default_endpoint() -> str:
    return f"ipc://{default_socket_dir() / SOCKET_NAME}"


def client_endpoint(explicit: str | None = None) -> str:
    """What a client connects to: the argument, else ``$CUCTXD_ENDPOINT``, else the default."""
    return explicit or os.environ.get(ENDPOINT_ENV) or default_endpoint()

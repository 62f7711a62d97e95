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


#: The system daemon's socket: where the shipped systemd unit and the Kubernetes DaemonSet listen.
SYSTEM_SOCKET = "/run/cuctxd/cuctxd.sock"


def client_endpoint(explicit: str | None = None, *, system_socket: str = SYSTEM_SOCKET) -> str:
    """What a client connects to, in this order: the argument; ``$CUCTXD_ENDPOINT``; the per-user socket
    (:func:`default_endpoint`) where it exists; the system socket (``system_socket``) where it exists; else the
    per-user socket (what the error then names, as the one ``cuctxd`` started by this user listens on)."""
    if explicit or os.environ.get(ENDPOINT_ENV):
        return explicit or os.environ[ENDPOINT_ENV]
    own = default_socket_dir() / SOCKET_NAME
    if not own.exists() and os.path.exists(system_socket):
        return f"ipc://{system_socket}"
    return f"ipc://{own}"


#: Longest ipc:// path the kernel takes (``sun_path`` is 108 bytes with its NUL).
MAX_IPC_PATH = 107


class BadEndpoint(ValueError):
    """An endpoint string ZeroMQ would refuse (or misread); the message says what to write instead."""


def check_endpoint(url: object, *, bind: bool = False) -> str:
    """``url`` if it is an ``ipc://PATH`` or ``tcp://HOST:PORT`` endpoint, else :class:`BadEndpoint`.

    The one validator for both sides: the daemon checks what it will bind
    (``bind=True``: ``*`` may stand for any host or any port), a client what it
    will connect to, so neither hands ZeroMQ a string it fails on with a bare
    ``Invalid argument``.
    """
    if not isinstance(url, str) or not url:
        raise BadEndpoint(f"must be a non-empty ipc:// or tcp:// URL, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise BadEndpoint(f"{url!r} is not an ipc:// or tcp:// URL{_hint(url)}")
    if scheme == "ipc":
        if not rest:
            raise BadEndpoint(f"{url!r} names no socket path (e.g. ipc:///run/cuctxd/cuctxd.sock)")
        if len(rest.encode()) > MAX_IPC_PATH:
            raise BadEndpoint(f"{url!r}: the socket path is {len(rest.encode())} bytes, more than the "
                              f"{MAX_IPC_PATH} a Unix socket allows")
        return url
    if scheme == "tcp":
        _check_tcp(url, rest, bind)
        return url
    raise BadEndpoint(f"{url!r} is not an ipc:// or tcp:// URL (cuctxd speaks ZeroMQ, not {scheme}://)")


def _hint(text: str) -> str:
    if text.startswith(("/", ".", "~")):
        return f"; for a socket file write ipc://{text}"
    host, colon, port = text.rpartition(":")
    if colon and host and port.isdigit():
        return f"; for a TCP port write tcp://{text}"
    return ""


def _check_tcp(url: str, rest: str, bind: bool) -> None:
    host, colon, port = rest.rpartition(":")
    example = "tcp://127.0.0.1:5555" + (" or tcp://127.0.0.1:* for any free port" if bind else "")
    if not colon or not host or (host.startswith("[") and not host.endswith("]")):
        raise BadEndpoint(f"{url!r} needs a host and a port, e.g. {example}")
    if bind and port == "*":
        return
    if not bind and host == "*":
        raise BadEndpoint(f"{url!r}: * is for a daemon to listen on; connect to a host name or address")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise BadEndpoint(f"{url!r}: the port must be 1..65535{' or *' if bind else ''}, got {port!r}")

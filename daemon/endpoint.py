"""Preparing and removing the daemon's ipc:// socket file and its private directory.

The default endpoint itself is defined in :mod:`protos.endpoints`, shared with clients.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, or None for other transports."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


class EndpointInUse(RuntimeError):
    """Another daemon already answers on this ipc:// socket."""


def prepare_ipc(path: Path) -> None:
    """Make the socket's directory private (0700, ours) and clear a stale socket file.

    Raises :class:`EndpointInUse` if a live daemon holds the socket, and
    PermissionError if the directory belongs to someone else.
    """
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) & 0o077 and directory.name.startswith("cuctxd"):
        directory.chmod(0o700)
    if path.exists():
        if _socket_is_live(path):
            raise EndpointInUse(f"a daemon already listens on ipc://{path}")
        path.unlink()


def _socket_is_live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def remove_ipc(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()

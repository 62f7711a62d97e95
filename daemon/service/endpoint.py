"""Preparing and removing the daemon's ipc:// socket file and its private directory.

The default endpoint itself is defined in :mod:`cuctxd.protos.endpoints`, shared with clients.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
from pathlib import Path


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, or None for other transports."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def lane_endpoint(endpoint: str, device: int) -> str:
    """Where device ``device``'s own ROUTER binds next to the front's ``endpoint``.

    ipc: the socket file plus ``-dev<N>``, in the same private directory; tcp:
    the same host, a port of the kernel's choosing.
    """
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rpartition(":")[0]
        return f"tcp://{host}:*"
    return f"{endpoint}-dev{device}"


class EndpointInUse(RuntimeError):
    """Another daemon already answers on this ipc:// socket."""


def group_id(group: str) -> int:
    """The gid of ``group`` (a name or a number); KeyError if there is none."""
    return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid


def prepare_ipc(path: Path, group: str | None = None) -> None:
    """Make the socket's directory ours and private, and clear a stale socket file.

    Private is 0700; with ``group`` it is 0770 and owned by that group, so its
    members can reach the socket (:func:`open_ipc_socket` does the file). Raises
    :class:`EndpointInUse` if a live daemon holds the socket, PermissionError if
    the directory belongs to someone else or cannot be given to ``group`` (this
    user must be a member of it).
    """
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {info.st_uid}, not to this user")
    if group is not None:
        gid = group_id(group)
        if info.st_gid != gid:
            try:
                os.chown(directory, -1, gid)
            except PermissionError:
                raise PermissionError(f"cannot give {directory} to group {group!r}: this user is not a member "
                                      "of it") from None
        directory.chmod(0o770)
    elif stat.S_IMODE(info.st_mode) & 0o077 and directory.name.startswith("cuctxd"):
        directory.chmod(0o700)
    if path.exists():
        if _socket_is_live(path):
            raise EndpointInUse(f"a daemon already listens on ipc://{path}")
        path.unlink()


def open_ipc_socket(path: Path, group: str | None = None) -> None:
    """Set the mode of a freshly bound socket file: 0600, or 0660 owned by ``group``."""
    if group is None:
        path.chmod(0o600)
        return
    os.chown(path, -1, group_id(group))
    path.chmod(0o660)


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

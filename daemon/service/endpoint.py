"""Preparing and removing the daemon's ipc:// socket file and its private directory.

The default endpoint itself is defined in :mod:`cuctxd.protos.endpoints`, shared with clients.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
import time
from pathlib import Path

from cuctxd.daemon.intake.listeners import PAUSED_NAME

log = logging.getLogger(__name__)


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
    """Make sure the socket's directory is safe to bind in, and clear a stale socket file.

    The directory is never reached through a symbolic link and must belong to
    this user. A directory this call creates is private (0700), or 0770 owned by
    ``group`` so its members can reach the socket (:func:`open_ipc_socket` sets
    the file's own mode); so is the service manager's runtime directory for this
    service (``$RUNTIME_DIRECTORY``, systemd's ``RuntimeDirectory=``, made 0700
    by the shipped unit), which exists for the daemon alone. Any other directory
    that already exists keeps its mode and group: the daemon never changes a
    directory it was not given (a warning says when group members could not
    enter it). A socket file left by a daemon that ended
    without cleaning up (SIGKILL, a crash) is removed, and the log says so, as
    is one it left moved aside while paused at ``max_connections``
    (:func:`clear_stale_paused`).

    Raises :class:`EndpointInUse` if a live daemon holds the socket (paused or not), and
    PermissionError if the directory is a symbolic link or someone else's, if it
    cannot be given to ``group`` (this user must be a member of it), or if
    something that is not a socket sits at ``path``.
    """
    directory = path.parent
    try:
        directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
        created = True
    except FileExistsError:
        created = False
    except (NotADirectoryError, FileNotFoundError):
        raise PermissionError(_not_a_directory(directory)) from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionError(_not_a_directory(directory)) from None
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise PermissionError(f"{directory} belongs to uid {info.st_uid}, not to this user")
        if created or _is_runtime_directory(directory):
            _make_private(fd, directory, group)
        elif group is not None and not info.st_mode & stat.S_IXGRP:
            log.warning("group %s cannot enter %s (mode %04o); it was not made by this daemon, so its mode stays: "
                        "chmod g+x it, or let the daemon create a new directory", group, directory,
                        stat.S_IMODE(info.st_mode))
    finally:
        os.close(fd)
    clear_stale_paused(path)
    clear_stale_socket(path)


def _not_a_directory(directory: Path) -> str:
    """Why ``directory`` cannot hold the socket: the first part of its path that is a symbolic link or a
    file, not a directory."""
    for part in [*reversed(directory.parents), directory]:
        try:
            mode = part.lstat().st_mode
        except OSError:
            break
        if stat.S_ISLNK(mode):
            return (f"{part} is a symbolic link: refusing to bind a socket through it (give the endpoint's real "
                    "directory)")
        if not stat.S_ISDIR(mode):
            return f"{part} is a file, not a directory: the endpoint's socket cannot go under it"
    return f"{directory} is not a plain directory: refusing to bind a socket there"


#: Set by systemd (v240+) for a unit with ``RuntimeDirectory=``: the directories made for this service.
RUNTIME_DIRECTORY_ENV = "RUNTIME_DIRECTORY"


def _is_runtime_directory(directory: Path) -> bool:
    """Whether the service manager made ``directory`` for this service alone (``$RUNTIME_DIRECTORY``)."""
    given = [Path(entry) for entry in os.environ.get(RUNTIME_DIRECTORY_ENV, "").split(":") if entry]
    return any(entry == directory for entry in given)


def _make_private(fd: int, directory: Path, group: str | None) -> None:
    """Set the mode (and group) of a directory this daemon just created, through its open descriptor."""
    if group is None:
        os.fchmod(fd, 0o700)
        return
    try:
        os.fchown(fd, -1, group_id(group))
    except PermissionError:
        raise PermissionError(f"cannot give {directory} to group {group!r}: this user is not a member of it") from None
    os.fchmod(fd, 0o770)


def clear_stale_socket(path: Path) -> None:
    """Remove a socket file a daemon that did not clean up left at ``path`` (logged); PermissionError for
    anything else there, :class:`EndpointInUse` if a live process still listens on it."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise PermissionError(f"{path} exists and is not a socket: refusing to replace it")
    if _socket_is_live(path):
        raise EndpointInUse(f"a daemon already listens on ipc://{path}")
    path.unlink()
    log.warning("removed the stale socket %s, left by a daemon that did not clean up (killed or crashed)", path)


#: An empty paused directory younger than this may be a live daemon's between making it and moving its
#: socket file in (or between taking the file out and removing it): left alone.
PAUSED_SETTLE_S = 10.0


def clear_stale_paused(path: Path) -> None:
    """Remove what a daemon killed while paused at ``max_connections`` left beside ``path``.

    A paused ipc:// listener's socket file waits in a ``.paused-*`` directory
    next to it (:mod:`cuctxd.daemon.intake.listeners`); a daemon killed then
    leaves both. Only directories this daemon could have made are touched: of
    this user, so named, not a link, and holding nothing (older than
    :data:`PAUSED_SETTLE_S`) or only a socket named as ``path``'s that no one
    listens on; each removal is logged. Another endpoint's are left alone.
    Raises :class:`EndpointInUse` if a live daemon, paused, holds ``path``'s.
    """
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return
    for entry in entries:
        if not PAUSED_NAME.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        info = entry.stat(follow_symlinks=False)
        if info.st_uid != os.geteuid():
            continue
        directory = Path(entry.path)
        try:
            inside = os.listdir(directory)
        except OSError:
            continue
        if inside == [path.name]:
            parked = directory / path.name
            if not stat.S_ISSOCK(parked.lstat().st_mode):
                continue
            if _socket_is_live(parked):
                raise EndpointInUse(f"a daemon already listens on ipc://{path}, paused at max_connections (its "
                                    f"socket file is in {directory})")
            parked.unlink()
        elif inside or time.time() - info.st_mtime < PAUSED_SETTLE_S:
            continue
        try:
            directory.rmdir()
        except OSError as exc:
            log.warning("cannot remove %s, left by a daemon killed while refusing connections: %s", directory, exc)
            continue
        log.warning("removed %s, left by a daemon killed while it refused connections at max_connections", directory)


def open_ipc_socket(path: Path, group: str | None = None) -> None:
    """Set the mode of a freshly bound socket file: 0600, or 0660 owned by ``group``.

    The file is checked to be a socket first (never a link planted meanwhile),
    and its owner is changed without following links.
    """
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise PermissionError(f"{path} is no longer the socket this daemon bound")
    if group is None:
        path.chmod(0o600)
        return
    os.chown(path, -1, group_id(group), follow_symlinks=False)
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

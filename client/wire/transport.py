"""What every transport of the client shares: calls in flight, timeouts, and whether the daemon is still there.

The socket transports (:mod:`cuctxd.client.wire.socket_transport`, its asyncio
twin :mod:`cuctxd.client.wire.async_socket_transport`) and the shm lane
(:mod:`cuctxd.client.wire.shm_lane`) each import what they share from here, and
nothing from each other: a :class:`Call` (a request in flight, resolved by the
transport that reads its reply), the errors a wait ends in (:func:`no_reply`,
:func:`no_daemon`, :func:`daemon_restarted`) and the :class:`DaemonWatch` that
probes an ipc:// daemon while a reply is awaited (:func:`listening`).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from cuctxd.protos.errors import CuctxError, DaemonRestarted, DaemonTimeout, NoAccess, NoDaemon

T = TypeVar("T")

#: What a request reaches: the devices it touches, or None for every device (front ops).
Reach = frozenset[int] | None

#: Seconds a call waits for its reply unless the client is told otherwise.
DEFAULT_TIMEOUT = 30.0

#: Seconds between checks, while a reply is awaited, that an ipc:// daemon still listens (:func:`listening`).
PROBE_EVERY = 1.0


def _ipc_path(endpoint: str) -> str | None:
    """The socket address of an ipc:// endpoint (Linux's abstract namespace, ``@name``, as ``\\0name``)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return "\0" + path[1:] if path.startswith("@") else path


def socket_identity(endpoint: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of an ipc:// endpoint's socket file: a daemon started anew there binds a new
    file. None for other transports, the abstract namespace, or no file."""
    path = _ipc_path(endpoint)
    if path is None or path.startswith("\0"):
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def listening(endpoint: str) -> bool:
    """False when ``endpoint`` is an ipc:// socket that nobody listens on: no socket file, or one that refuses
    connections (its daemon died). True otherwise: a plain AF_UNIX connect, no handshake, so it costs the
    daemon nothing; other transports cannot be told apart from a slow daemon without a handshake."""
    path = _ipc_path(endpoint)
    if path is None:
        return True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a full backlog answers EAGAIN at once: someone is listening
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:
            return True
    return True


def access_problem(endpoint: str) -> str | None:
    """Why this process may not connect to an ipc:// endpoint (the kernel said "permission denied"): the first
    directory on the socket's path it may not enter, or the socket file it may not write, with what to change.
    None when it may (or the endpoint is not an ipc:// file, or nothing is there: :func:`listening` says)."""
    path = _ipc_path(endpoint)
    if path is None or path.startswith("\0"):
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except PermissionError:
            pass
        except OSError:
            return None
        else:
            return None
    socket_path = Path(path)
    you = f"this user ({_user(os.getuid())}, uid {os.getuid()})"
    for directory in reversed(socket_path.parents):  # from / down
        if not os.access(directory, os.X_OK):
            return (f"cannot reach {endpoint}: permission denied: {you} may not enter {directory} "
                    f"({_owner_text(directory)}); {_fix(directory)}")
    return (f"cannot reach {endpoint}: permission denied: {you} may not write the socket {socket_path} "
            f"({_owner_text(socket_path)}); {_fix(socket_path)}")


def no_access(endpoint: str, op: str | None = None) -> NoAccess | None:
    """:class:`NoAccess` when :func:`access_problem` finds one, else None."""
    problem = access_problem(endpoint)
    return None if problem is None else NoAccess(problem, op)


def _owner_text(path: Path) -> str:
    try:
        info = path.stat()
    except OSError:
        return "owner unknown"
    return (f"mode {stat.S_IMODE(info.st_mode):04o}, owner {_user(info.st_uid)}, group "
            f"{_group(info.st_gid)}")


def _fix(path: Path) -> str:
    """What to change so that this user may connect: the daemon's user, or its ``group`` setting."""
    try:
        info = path.stat()
    except OSError:
        return "run as the daemon's user, or have the daemon let your group in"
    owner, group = _user(info.st_uid), _group(info.st_gid)
    if info.st_mode & stat.S_IRWXG:
        return (f"run as {owner}, or join the group {group} (then log in again) that the daemon lets in "
                "(its `group` setting)")
    return (f"only {owner} may connect: run as {owner}, or have the daemon started with `group = \"GROUP\"` "
            "(--group) so the members of GROUP may connect, and join that group")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def not_listening(endpoint: str) -> str:
    return f"no cuctxd is listening at {endpoint}; start it with `cuctxd`"


def no_daemon(endpoint: str, op: str | None = None) -> NoDaemon:
    return NoDaemon(not_listening(endpoint), op)


def daemon_restarted(endpoint: str, op: str | None = None) -> DaemonRestarted:
    return DaemonRestarted(f"the cuctxd that held this session at {endpoint} exited and another one listens there "
                           "now; it does not know this session", op)


class DaemonWatch:
    """Whether the daemon at an endpoint is still there, and still the one a transport was connected to:
    probed while a reply is awaited (a request sent to a daemon that then died gets no reply from the
    one started in its place, however long the wait)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.identity = socket_identity(endpoint)

    def alive(self, op: str | None) -> bool:
        """True while the same daemon listens; False when nothing does; :class:`DaemonRestarted` when another
        one does (its socket file is a new one)."""
        if not listening(self.endpoint):
            return False
        if self.identity is not None and socket_identity(self.endpoint) not in (self.identity, None):
            raise daemon_restarted(self.endpoint, op)
        return True


def no_reply(endpoint: str, limit: float, op: str, curve: bool = False) -> DaemonTimeout:
    """A call's reply did not come within ``limit`` s; ``curve``: over a CURVE socket (the key setup may be
    why)."""
    if not curve:
        return DaemonTimeout(f"no reply from {endpoint} within {limit:g} s", op)
    return DaemonTimeout(
        f"no reply from {endpoint} within {limit:g} s over CURVE; a daemon that refuses the handshake says "
        "nothing, so check the key setup: server_key must be the daemon's public key file and this client's "
        "public key (NAME.key of client_key) must be in the daemon's allow_dir, or the daemon is not running",
        op)


class Waits(Protocol):
    """What a :class:`Call` waits on: a socket (:mod:`cuctxd.client.wire.socket_transport`) or an shm lane
    (:mod:`cuctxd.client.wire.shm_lane`)."""

    def wait(self, call: Call[Any], timeout: float | None = None) -> None: ...

    def abandon(self, call: Call[Any]) -> None: ...


class Call(Generic[T]):
    """A request in flight; :meth:`result` waits for its reply (and reads others on the way)."""

    __slots__ = ("_convert", "_error", "_frames", "_result", "done", "into", "op", "reach", "request_id",
                 "transport")

    def __init__(self, transport: Waits, request_id: int, op: str, into: Any,
                 convert: Callable[[dict[str, Any], list[Any]], T], reach: Reach = None) -> None:
        self.transport = transport
        self.request_id = request_id
        self.op = op
        self.into = into
        #: The devices the request touches (None: all), for ordering across transports
        #: (:mod:`cuctxd.client.wire.routes`).
        self.reach = reach
        self._convert = convert
        self.done = False
        self._result: dict[str, Any] = {}
        self._frames: list[Any] = []
        self._error: CuctxError | None = None

    def _resolve(self, result: dict[str, Any] | None, frames: list[Any], error: CuctxError | None) -> None:
        self.done = True
        self._result, self._frames, self._error = result or {}, frames, error

    def result(self, timeout: float | None = None) -> T:
        """The converted result; raises the daemon's typed error or :class:`DaemonTimeout`."""
        if not self.done:
            self.transport.wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self._convert(self._result, self._frames)


class Sender(Protocol):
    """A transport that sends a request and returns its :class:`Call` (the socket an shm lane falls back to)."""

    def send(self, op: str, args: dict[str, Any], session: str | None, payload: Sequence[Any] = (), *,
             into: Any = None, convert: Callable[[dict[str, Any], list[Any]], Any] = ...,
             reach: Reach = None) -> Call[Any]: ...

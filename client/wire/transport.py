"""What every transport of the client shares: calls in flight, timeouts, and whether the daemon is still there.

The socket transports (:mod:`cuctxd.client.wire.socket_transport`, its asyncio
twin :mod:`cuctxd.client.wire.async_socket_transport`) and the shm lane
(:mod:`cuctxd.client.wire.shm_lane`) each import what they share from here, and
nothing from each other: a :class:`Call` (a request in flight, resolved by the
transport that reads its reply), the errors a wait ends in (:func:`no_reply`,
:func:`no_daemon`, :func:`daemon_restarted`) and the :class:`DaemonWatch` that
tells, while a reply is late, whether the daemon that holds the session is still there.
"""

from __future__ import annotations

import grp
import os
import pwd
import select
import socket
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import zmq

from cuctxd.client.wire import build
from cuctxd.protos.errors import CuctxError, DaemonRestarted, DaemonTimeout, NoAccess, NoDaemon
from cuctxd.protos.messages import encode_request, parse_reply

T = TypeVar("T")

#: What a request reaches: the devices it touches, or None for every device (front ops).
Reach = frozenset[int] | None

#: Seconds a call waits for its reply unless the client is told otherwise.
DEFAULT_TIMEOUT = 30.0

#: Seconds between checks, while a reply is awaited, that the daemon is still there (:class:`DaemonWatch`).
PROBE_EVERY = 1.0
#: Seconds a check waits for the daemon's answer to ``ping`` (or for a tcp connection) before it takes the
#: daemon as merely slow.
PROBE_TIMEOUT = 0.5


def _ipc_path(endpoint: str) -> str | None:
    """The socket address of an ipc:// endpoint (Linux's abstract namespace, ``@name``, as ``\\0name``)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return "\0" + path[1:] if path.startswith("@") else path


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


def _tcp_refused(endpoint: str) -> bool:
    """True when a tcp:// endpoint's host refuses a plain connection on its port (nobody listens there); False
    when one is made, or it cannot be told within :data:`PROBE_TIMEOUT` (a host that drops packets)."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def someone_listens(endpoint: str) -> bool:
    """Whether anyone listens at ``endpoint`` now: :func:`listening` for ipc://, a plain connection for tcp://
    (a refused one: nobody; a host that does not answer within :data:`PROBE_TIMEOUT` cannot be told, True).
    A client asks before ``hello``, so that a tcp:// endpoint with nothing there fails at once, not after the
    whole timeout."""
    if endpoint.startswith("tcp://"):
        return not _tcp_refused(endpoint)
    return listening(endpoint)


def _listener_pidfd(endpoint: str) -> int | None:
    """A pidfd of the process that listens on an ipc:// socket file now: its pid from ``SO_PEERCRED`` of a
    plain connection (the kernel gives it in this process's pid namespace, 0 when it is not there), then
    ``pidfd_open``. None for other transports, nobody listening, or no pidfds here."""
    path = _ipc_path(endpoint)
    if path is None or not hasattr(os, "pidfd_open"):
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
            pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            return None
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (the pidfd polls readable)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


class DaemonWatch:
    """Whether the daemon that holds a session is still there: shared by every transport of the session (the
    main socket, device sockets, shm lanes, the heartbeat's socket), asked when a reply is late (a request
    sent to a daemon that then died gets no reply from the one started in its place, however long the wait).

    The daemon's identity is its ``instance`` from ``hello``, random at each start (:meth:`expect`). Where
    the daemon listens on an ipc:// socket file of this host and pid namespace, the watch holds a pidfd of
    its process, taken before ``hello`` (:meth:`seen`) and kept only if that process still lives after it:
    it polls readable once the daemon exits, which needs no question to the daemon. Elsewhere (tcp://,
    another pid namespace) a check asks ``ping``, on a socket of its own made by ``dealer``, for the
    instance that answers now. Nothing listening there any more (no socket file, or a refused connection)
    means the daemon is gone. Once gone, it stays gone (:attr:`lost`): every transport of the session then
    fails its calls at once.

    Which thread may call: any; a check made by two threads at once asks twice.
    """

    def __init__(self, endpoint: str, dealer: Callable[[], zmq.Socket[Any]] | None = None) -> None:
        """``dealer``: a new DEALER connected to ``endpoint`` (with the client's CURVE keys), for ``ping``;
        None: checks never ask the daemon."""
        self.endpoint = endpoint
        self._dealer = dealer
        #: The instance the session lives in (None: not known, or a daemon that does not say).
        self.instance: str | None = None
        #: Why the daemon is taken as gone, once it is: :class:`NoDaemon` or :class:`DaemonRestarted`.
        self.lost: NoDaemon | None = None
        self._pidfd: int | None = None
        self._lock = threading.Lock()  # the pidfd: a check on another thread must not poll it once closed

    @classmethod
    def seen(cls, endpoint: str, dealer: Callable[[], zmq.Socket[Any]] | None = None) -> DaemonWatch:
        """A watch of the daemon that listens at ``endpoint`` now, with its pidfd where one can be had; made
        before ``hello`` is sent, so that the process it names is the one ``hello`` reaches or one that
        exited first (:meth:`expect` then drops it)."""
        watch = cls(endpoint, dealer)
        watch._pidfd = _listener_pidfd(endpoint)
        return watch

    def expect(self, instance: str | None) -> None:
        """The session lives in the daemon that answered ``hello`` with ``instance``. A pidfd whose process
        has exited by now named another daemon (``hello`` reached the next one): dropped."""
        self.instance = instance
        with self._lock:
            if self._pidfd is not None and _exited(self._pidfd):
                os.close(self._pidfd)
                self._pidfd = None

    @property
    def probes(self) -> bool:
        """Whether a late reply is worth a check before the timeout: there is a pidfd, a socket file, or an
        instance to ask about."""
        return self._pidfd is not None or self.endpoint.startswith("ipc://") or (
            self.instance is not None and self._dealer is not None)

    def check(self, op: str | None) -> NoDaemon | None:
        """None while the daemon is there, or cannot be told from a slow one; else the error a call of ``op``
        ends in: :class:`NoDaemon` (nothing listens any more) or :class:`DaemonRestarted` (another daemon
        does). Blocks for at most about :data:`PROBE_TIMEOUT` (twice for a tcp:// daemon that is silent)."""
        if self.lost is None:
            self.lost = self._find_gone()
        return self._error(op)

    def exited(self, op: str | None) -> NoDaemon:
        """The error for ``op`` now that the daemon's process is known to have exited (a pidfd of it, as an
        shm lane holds, polled readable)."""
        self.lost = self.lost or self._after_exit()
        error = self._error(op)
        assert error is not None
        return error

    def _error(self, op: str | None) -> NoDaemon | None:
        return None if self.lost is None else type(self.lost)(self.lost.message, op)

    def _find_gone(self) -> NoDaemon | None:
        with self._lock:
            if self._pidfd is not None:
                return self._after_exit() if _exited(self._pidfd) else None
        if not someone_listens(self.endpoint):
            return no_daemon(self.endpoint)
        if self.instance is None or self._dealer is None:
            return None
        answer = self._ping()
        if answer is not None and answer.get("instance") not in (None, self.instance):
            return daemon_restarted(self.endpoint)
        return None

    def _after_exit(self) -> NoDaemon:
        return daemon_restarted(self.endpoint) if someone_listens(self.endpoint) else no_daemon(self.endpoint)

    def _ping(self) -> dict[str, Any] | None:
        """``ping``'s result on a new socket, or None without one within :data:`PROBE_TIMEOUT`."""
        assert self._dealer is not None
        dealer = self._dealer()
        try:
            ping = build.ping()
            dealer.send(encode_request(1, ping.op, None, ping.args))
            if not dealer.poll(int(PROBE_TIMEOUT * 1000)):
                return None
            reply = parse_reply(dealer.recv())
        except (zmq.ZMQError, CuctxError):
            return None
        finally:
            dealer.close()
        return reply.result if reply.error is None and reply.result is not None else None

    def close(self) -> None:
        """Close the pidfd (the session ended)."""
        with self._lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None


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

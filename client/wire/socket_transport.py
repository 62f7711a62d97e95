"""The client's side of the wire: one DEALER socket, request ids, pipelining, timeouts.

Requests may be sent without waiting (:meth:`Transport.send` returns a
:class:`Call`); replies are matched to calls by id as they arrive, in any
order. A lock serialises socket use, since a ZeroMQ socket belongs to one thread
at a time. Replies to calls that already timed out are discarded, so a timeout
never makes a later call read someone else's answer. Matching a reply to its
call and reading its frames (:func:`match_reply`, :func:`read_payload`) serve
:mod:`cuctxd.client.wire.async_socket_transport` too.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import zmq
import zmq.auth

from cuctxd.client.wire.routes import Reach
from cuctxd.protos.errors import ConnectionLost, CuctxError, DaemonRestarted, DaemonTimeout, NoDaemon, error_from_wire
from cuctxd.protos.messages import ReplyHeader, encode_request, parse_reply

#: Seconds a call waits for its reply unless the client is told otherwise.
DEFAULT_TIMEOUT = 30.0

#: Seconds between checks, while a reply is awaited, that an ipc:// daemon still listens (:func:`listening`).
PROBE_EVERY = 1.0

#: Most requests one connection has waiting for replies (a sync pipeline then reads
#: replies; async calls queue for a slot): bounded so neither side's ZeroMQ queue
#: (1,000 messages by default) can overflow.
MAX_IN_FLIGHT = 256

T = TypeVar("T")
P = TypeVar("P")
SocketT = TypeVar("SocketT", bound=zmq.Socket[Any])
#: A key file's path.
KeyPath = str | os.PathLike[str]


@dataclass(frozen=True)
class CurveKeys:
    """What a client needs to reach a daemon that runs CURVE: its public key and a key pair of ours.

    Build it with :meth:`load`. The daemon lets the client in only if ``public``
    is in its ``allow_dir``; when it is not (or ``server_public`` is wrong) the
    handshake fails without a word and calls end in :class:`DaemonTimeout`.
    """

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key: KeyPath, client_key: KeyPath | None) -> CurveKeys:
        """``server_key``: the daemon's public key file (``server.key``); ``client_key``: this client's
        secret key file (``NAME.key_secret``), or None for a throwaway pair (encryption only: a daemon
        with an ``allow_dir`` turns it away). Raises ValueError naming the file that is wrong."""
        server_public, _ = _load_key_file(server_key, "server_key")
        if client_key is None:
            public, secret = zmq.curve_keypair()
            return cls(server_public, public, secret)
        public, client_secret = _load_key_file(client_key, "client_key")
        if client_secret is None:
            raise ValueError(f"client_key {os.fspath(client_key)!r} holds no secret key: give NAME.key_secret")
        return cls(server_public, public, client_secret)

    def apply(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` a CURVE client of the daemon; before it connects."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret


def _load_key_file(path: KeyPath, what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read a CURVE key from {os.fspath(path)!r}: {exc}") from None
    return public, secret


def curve_keys(server_key: KeyPath | CurveKeys | None,
               client_key: KeyPath | None) -> CurveKeys | None:
    """The keys a client was given (paths, or ready :class:`CurveKeys`), or None for no CURVE."""
    if isinstance(server_key, CurveKeys):
        return server_key
    if server_key is None:
        if client_key is not None:
            raise ValueError("client_key needs server_key (the daemon's public key file) as well")
        return None
    return CurveKeys.load(server_key, client_key)


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


def no_daemon(endpoint: str, op: str | None = None) -> NoDaemon:
    return NoDaemon(f"no cuctxd is listening at {endpoint}; start it with `cuctxd`", op)


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


def connect_dealer(context: zmq.Context[SocketT], endpoint: str, curve: CurveKeys | None = None) -> SocketT:
    """A DEALER connected to ``endpoint`` that drops unsent requests when closed; a CURVE client with ``curve``."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(socket)
    socket.connect(endpoint)
    return socket


def match_reply(header: bytes, in_flight: Mapping[int, P]) -> tuple[ReplyHeader | None, P | None]:
    """Decode a reply header and find the request it answers among ``in_flight`` (by id).

    A reply with id 0 and an error is the daemon saying it could not read a request
    of ours: it goes to the oldest. ``(None, None)`` for a frame that is no reply;
    ``(reply, None)`` for a reply to nothing waiting (a call that timed out).
    """
    try:
        reply = parse_reply(header)
    except CuctxError:
        return None, None
    target = in_flight.get(reply.id)
    if target is None and reply.id == 0 and reply.error is not None and in_flight:
        target = in_flight[min(in_flight)]
    return reply, target


_RCVMORE = int(zmq.RCVMORE)  # a plain int: pyzmq's option enums cost a lookup per use


def no_reply(endpoint: str, limit: float, op: str, curve: CurveKeys | None = None) -> DaemonTimeout:
    if curve is None:
        return DaemonTimeout(f"no reply from {endpoint} within {limit:g} s", op)
    return DaemonTimeout(
        f"no reply from {endpoint} within {limit:g} s over CURVE; a daemon that refuses the handshake says "
        "nothing, so check the key setup: server_key must be the daemon's public key file and this client's "
        "public key (NAME.key of client_key) must be in the daemon's allow_dir, or the daemon is not running",
        op)


def read_payload(socket: zmq.Socket[Any], into: Any, more: bool) -> list[Any]:
    """The payload frames of a reply whose header was just received (ZeroMQ delivers a
    message whole, so they are all there): the first straight into ``into`` when given.
    ``more``: the header frame's flag (there are payload frames)."""
    frames: list[Any] = []
    if more and into is not None:
        frames.append(socket.recv_into(into))
        more = bool(socket.getsockopt(_RCVMORE))
    while more:
        frame = socket.recv(copy=False)
        frames.append(frame)
        more = frame.more
    return frames


class Waits(Protocol):
    """What a :class:`Call` waits on: a :class:`Transport`, or an shm lane (:mod:`cuctxd.client.wire.shm_lane`)."""

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
        #: The devices the request touches (None: all), for ordering across lanes (:mod:`cuctxd.client.wire.routes`).
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


def _raw(result: dict[str, Any], frames: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    return result, frames


class Transport:
    """A connection to one daemon endpoint.

    ``daemon``: the endpoint the user gave, when ``endpoint`` is one the client found
    (a device's own socket): errors name it, and while a reply is awaited the client
    checks every :data:`PROBE_EVERY` s that an ipc:// daemon still listens there,
    raising :class:`~cuctxd.protos.errors.NoDaemon` at once when not.
    """

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, curve: CurveKeys | None = None, *,
                 daemon: str | None = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.curve = curve
        self.daemon = daemon or endpoint
        self._watch = DaemonWatch(self.daemon)
        self._probe_ms = int(PROBE_EVERY * 1000) if self.daemon.startswith("ipc://") else None
        self._socket: zmq.Socket[bytes] = connect_dealer(zmq.Context.instance(), endpoint, curve)
        self._socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._in_flight: dict[int, Call[Any]] = {}
        self._rcvtimeo = -1
        self._closed = False

    def call(self, op: str, args: dict[str, Any], session: str | None, payload: Sequence[Any] = (), *,
             into: Any = None, timeout: float | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Send one request and wait for its reply: ``(result, payload frames)``.

        ``into``: a writable buffer that receives the reply's first payload frame
        directly (``recv_into``), so large reads land where the caller wants them.
        """
        return self.send(op, args, session, payload, into=into).result(timeout)

    def send(self, op: str, args: dict[str, Any], session: str | None, payload: Sequence[Any] = (), *,
             into: Any = None, convert: Callable[[dict[str, Any], list[Any]], Any] = _raw,
             reach: Reach = None) -> Call[Any]:
        """Send a request without waiting for its reply; with :data:`MAX_IN_FLIGHT` waiting, first
        wait for the oldest."""
        with self._lock:
            if self._closed:
                raise ConnectionLost("the client is closed", op)
            while len(self._in_flight) >= MAX_IN_FLIGHT:
                self.wait(next(iter(self._in_flight.values())))
            request_id = next(self._ids)
            header = encode_request(request_id, op, session, args)
            try:  # SNDTIMEO bounds a send that cannot leave (no daemon, or its queue is full)
                if payload:
                    self._socket.send_multipart([header, *payload], copy=False)
                else:
                    self._socket.send(header)
            except zmq.Again:
                if not listening(self.daemon):
                    raise no_daemon(self.daemon, op) from None
                raise DaemonTimeout(f"could not send to {self.daemon} within {self.timeout:g} s", op) from None
            call: Call[Any] = Call(self, request_id, op, into, convert, reach)
            self._in_flight[request_id] = call
            return call

    def abandon(self, call: Call[Any]) -> None:
        """Stop waiting for ``call``: a reply that still comes is dropped like a late one."""
        with self._lock:
            self._in_flight.pop(call.request_id, None)
            if not call.done:
                abandoned = DaemonTimeout(f"abandoned: an earlier request found {self.daemon} gone or silent",
                                           call.op)
                call._resolve(None, [], abandoned)

    @property
    def busy(self) -> bool:
        """Some call is waiting for its reply."""
        return bool(self._in_flight)

    def in_flight(self) -> list[Call[Any]]:
        """The calls sent and not answered yet, oldest first."""
        return list(self._in_flight.values())

    def wait(self, call: Call[Any], timeout: float | None = None) -> None:
        """Read replies until ``call``'s has come; :class:`DaemonTimeout` after ``timeout`` s."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        limit_ms = max(1, int(limit * 1000))
        slice_ms = limit_ms if self._probe_ms is None else min(limit_ms, self._probe_ms)
        with self._lock:
            while not call.done:
                left_ms = (deadline - time.monotonic()) * 1000
                header = None
                if left_ms > 0:
                    # A blocking recv with RCVTIMEO costs one call less per reply than poll + recv;
                    # the option is set again only when the time left is short of the usual slice.
                    want = slice_ms if left_ms >= slice_ms - 1 else max(1, int(left_ms))
                    if want != self._rcvtimeo:
                        self._socket.setsockopt(zmq.RCVTIMEO, want)
                        self._rcvtimeo = want
                    try:
                        header = self._socket.recv(copy=False)
                    except zmq.Again:
                        header = None
                if header is None:
                    try:
                        alive = self._watch.alive(call.op)
                    except DaemonRestarted:
                        self._in_flight.pop(call.request_id, None)
                        raise
                    if alive and time.monotonic() < deadline:
                        continue  # a slice passed and the same daemon still listens: wait on
                    self._in_flight.pop(call.request_id, None)
                    if alive:
                        raise no_reply(self.daemon, limit, call.op, self.curve)
                    raise no_daemon(self.daemon, call.op)
                self._receive_one(header)

    def _receive_one(self, header: zmq.Frame) -> None:
        reply, target = match_reply(header.bytes, self._in_flight)
        frames = read_payload(self._socket, None if target is None else target.into, header.more)
        if reply is None or target is None:
            return  # not a reply of ours, or a late one to a call that timed out
        del self._in_flight[target.request_id]
        error = None if reply.error is None else error_from_wire(reply.error, target.op)
        target._resolve(reply.result, frames, error)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._socket.close()

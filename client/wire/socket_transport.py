"""The socket transport: one DEALER socket to one daemon endpoint, request ids, pipelining, timeouts.

Requests may be sent without waiting (:meth:`Transport.send` returns a
:class:`Call`); replies are matched to calls by id as they arrive, in any
order. A lock serialises socket use, since a ZeroMQ socket belongs to one thread
at a time. Replies to calls that already timed out are discarded, so a timeout
never makes a later call read someone else's answer. Matching a reply to its
call and reading its frames (:func:`match_reply`, :func:`read_payload`) serve
:mod:`cuctxd.client.wire.async_socket_transport` too; what every transport shares is in
:mod:`cuctxd.client.wire.transport`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import zmq
import zmq.auth

from cuctxd.client.wire.transport import (
    DEFAULT_TIMEOUT,
    PROBE_EVERY,
    Call,
    DaemonWatch,
    Reach,
    listening,
    no_daemon,
    no_reply,
)
from cuctxd.protos.errors import ConnectionLost, CuctxError, DaemonTimeout, NoDaemon, error_from_wire
from cuctxd.protos.messages import ReplyHeader, encode_request, parse_reply

#: Most requests one connection has waiting for replies (a sync pipeline then reads
#: replies; async calls queue for a slot): bounded so neither side's ZeroMQ queue
#: (1,000 messages by default) can overflow.
MAX_IN_FLIGHT = 256

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


def connect_dealer(context: zmq.Context[SocketT], endpoint: str, curve: CurveKeys | None = None) -> SocketT:
    """A DEALER connected to ``endpoint`` that drops unsent requests when closed; a CURVE client with ``curve``."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(socket)
    socket.connect(endpoint)
    return socket


def daemon_watch(endpoint: str, curve: CurveKeys | None) -> DaemonWatch:
    """The :class:`DaemonWatch` of a session with the daemon at ``endpoint`` (before its ``hello``); its
    ``ping`` goes on sockets of the process-wide ZeroMQ context, whatever the client's flavour."""
    return DaemonWatch.seen(endpoint, partial(connect_dealer, zmq.Context.instance(), endpoint, curve))


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


def _raw(result: dict[str, Any], frames: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    return result, frames


class Transport:
    """A connection to one daemon endpoint.

    ``daemon``: the endpoint the user gave, when ``endpoint`` is one the client found
    (a device's own socket): errors name it. ``watch``: the session's :class:`DaemonWatch`
    (default: one of ``daemon`` that knows no instance); while a reply is awaited it is
    asked every :data:`PROBE_EVERY` s whether the daemon is still there, and once it is
    not, every call in flight here fails at once with
    :class:`~cuctxd.protos.errors.NoDaemon` (or ``DaemonRestarted``).
    """

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, curve: CurveKeys | None = None, *,
                 daemon: str | None = None, watch: DaemonWatch | None = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.curve = curve
        self.daemon = daemon or endpoint
        self._watch = watch or DaemonWatch(self.daemon)
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
        """Read replies until ``call``'s has come; :class:`DaemonTimeout` after ``timeout`` s, ``NoDaemon`` (every
        call in flight here resolved with it) once the daemon is found gone."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        limit_ms = max(1, int(limit * 1000))
        slice_ms = min(limit_ms, int(PROBE_EVERY * 1000)) if self._watch.probes else limit_ms
        with self._lock:
            while not call.done:
                left_ms = (deadline - time.monotonic()) * 1000
                header = None
                if left_ms > 0 and self._watch.lost is None:
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
                if header is not None:
                    self._receive_one(header)
                    continue
                gone = self._watch.check(call.op)
                if gone is not None:
                    self._fail_all(gone)
                elif time.monotonic() >= deadline:
                    self._in_flight.pop(call.request_id, None)
                    raise no_reply(self.daemon, limit, call.op, curve=self.curve is not None)

    def _fail_all(self, gone: NoDaemon) -> None:
        """The daemon is gone: no call in flight here will get a reply (under the lock)."""
        for waiting in self._in_flight.values():
            waiting._resolve(None, [], type(gone)(gone.message, waiting.op))
        self._in_flight.clear()

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

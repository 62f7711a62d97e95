"""The async client's side of the wire: one ``zmq.asyncio`` DEALER socket shared by every task.

Any number of tasks may call at once. Each call registers a future under a
fresh request id and sends; one reader task (started by the first call) receives
every reply and resolves the future with that id, in whatever order replies
come. Sends need no lock: ``zmq.asyncio`` sends each multipart message whole and
in call order. At most :data:`~cuctxd.client.wire.socket_transport.MAX_IN_FLIGHT` calls wait for
replies at once; the rest queue, in order, for a free slot (within their
timeout). A call that times out or is cancelled forgets its id, so its late reply
is dropped and never lands in a later call's buffer. Matching replies to calls
and reading their frames is shared with the sync :mod:`cuctxd.client.wire.socket_transport`.

A transport belongs to the event loop that first used it, like the socket under it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from cuctxd.client.wire.socket_transport import MAX_IN_FLIGHT, CurveKeys, connect_dealer, match_reply, read_payload
from cuctxd.client.wire.transport import DEFAULT_TIMEOUT, PROBE_EVERY, DaemonWatch, Reach, no_reply
from cuctxd.protos.errors import ConnectionLost, CuctxError, error_from_wire
from cuctxd.protos.messages import encode_request

log = logging.getLogger(__name__)

Reply = tuple[dict[str, Any], list[Any]]


@dataclass
class _Waiting:
    """A call whose reply has not come: what the reader needs to deliver it."""

    request_id: int
    op: str
    into: Any
    reply: asyncio.Future[Reply]
    #: The devices the request touches (None: all), for ordering across transports (:mod:`cuctxd.client.wire.routes`).
    reach: Reach = None


class AsyncTransport:
    """A connection to one daemon endpoint, for coroutines of one event loop."""

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT, curve: CurveKeys | None = None, *,
                 daemon: str | None = None, watch: DaemonWatch | None = None) -> None:
        """``daemon`` and ``watch`` as for :class:`~cuctxd.client.wire.socket_transport.Transport`: errors
        name ``daemon``, and while calls wait the watch is asked every
        :data:`~cuctxd.client.wire.transport.PROBE_EVERY` s whether the daemon is still there (they fail with
        ``NoDaemon``, or ``DaemonRestarted``, once it is not)."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.curve = curve
        self.daemon = daemon or endpoint
        self._daemon_watch = watch or DaemonWatch(self.daemon)
        self._watch: asyncio.Task[None] | None = None
        self._socket = connect_dealer(zmq.asyncio.Context.instance(), endpoint, curve)
        # A plain view of the same socket, for the rest of a message whose first frame has come.
        self._frames: zmq.Socket[Any] = zmq.Socket.shadow(self._socket.underlying)
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self._window = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._reader: asyncio.Task[None] | None = None
        self._failure: CuctxError | None = None

    async def call(self, op: str, args: dict[str, Any], session: str | None, payload: Sequence[Any] = (), *,
                   into: Any = None, timeout: float | None = None, reach: Reach = None,
                   before: Callable[[], Awaitable[None]] | None = None,
                   sent: Callable[[], None] | None = None) -> Reply:
        """Send one request and await its reply: ``(result, payload frames)``.

        Raises the daemon's typed error, :class:`~cuctxd.protos.errors.DaemonTimeout` after
        ``timeout`` seconds (default: the transport's), or
        :class:`~cuctxd.protos.errors.ConnectionLost` once the transport is closed or broken.
        ``into``: a writable buffer that receives the reply's first payload frame directly.
        ``before`` is awaited (within the timeout) just before sending and ``sent`` called
        just after: the client keeps its order across sockets with them.
        """
        limit = self.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit), self._window:
                if before is not None:
                    await before()
                return await self._exchange(op, args, session, payload, into, reach, sent)
        except TimeoutError as exc:
            if isinstance(exc, CuctxError):  # DaemonTimeout is a TimeoutError too: not this call's timeout
                raise
            raise no_reply(self.daemon, limit, op, curve=self.curve is not None) from None

    @property
    def busy(self) -> bool:
        """Some call is waiting for its reply."""
        return bool(self._waiting)

    def in_flight(self) -> list[_Waiting]:
        """The calls sent and not answered yet."""
        return list(self._waiting.values())

    async def _watch_daemon(self) -> None:
        """While calls wait, ask the watch every :data:`PROBE_EVERY` s whether the daemon is still there (on a
        thread: a check may wait for ``ping``); fail every waiting call once it is not."""
        watch = self._daemon_watch
        try:
            while self._waiting and watch.lost is None:
                await asyncio.sleep(PROBE_EVERY)
                if self._waiting:
                    await asyncio.to_thread(watch.check, None)
            if watch.lost is not None:
                for waiting in self._waiting.values():
                    if not waiting.reply.done():
                        waiting.reply.set_exception(type(watch.lost)(watch.lost.message, waiting.op))
        finally:
            self._watch = None

    async def _exchange(self, op: str, args: dict[str, Any], session: str | None, payload: Sequence[Any],
                        into: Any, reach: Reach, sent: Callable[[], None] | None) -> Reply:
        if self._failure is not None:
            raise ConnectionLost(self._failure.message, op)
        gone = self._daemon_watch.lost
        if gone is not None:  # found gone on another socket of the session: no reply can come
            raise type(gone)(gone.message, op)
        self._start_reader()
        waiting = _Waiting(next(self._ids), op, into, asyncio.get_running_loop().create_future(), reach)
        self._waiting[waiting.request_id] = waiting
        if self._watch is None and self._daemon_watch.probes:
            self._watch = asyncio.get_running_loop().create_task(self._watch_daemon(), name="cuctxd-watch")
        try:
            header = encode_request(waiting.request_id, op, session, args)
            await self._socket.send_multipart([header, *payload], copy=False)
            if sent is not None:
                sent()
            return await waiting.reply
        except zmq.ZMQError as exc:
            raise ConnectionLost(f"sending to {self.daemon} failed: {exc}", op) from exc
        finally:
            self._waiting.pop(waiting.request_id, None)

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(), name="cuctxd-replies")

    async def _read_replies(self) -> None:
        """The one reader: every reply goes to the future waiting under its id."""
        try:
            while True:
                header = await self._socket.recv(copy=False)
                reply, waiting = match_reply(header.bytes, self._waiting)
                if waiting is not None and waiting.reply.done():
                    waiting = None  # timed out or cancelled: its buffer is no longer ours to fill
                frames = read_payload(self._frames, None if waiting is None else waiting.into, header.more)
                if reply is None or waiting is None:
                    continue  # not a reply of ours, or a late one to a call that gave up
                del self._waiting[waiting.request_id]
                if reply.error is None:
                    waiting.reply.set_result((reply.result or {}, frames))
                else:
                    waiting.reply.set_exception(error_from_wire(reply.error, waiting.op))
        except Exception as exc:  # the socket or its context went away: every waiting call must hear of it
            log.warning("receiving from %s failed: %s", self.endpoint, exc, exc_info=True)
            self._fail(ConnectionLost(f"receiving from {self.endpoint} failed: {exc}"))

    def _fail(self, error: CuctxError) -> None:
        """Refuse new calls, and end every waiting one, with ``error``."""
        self._failure = self._failure or error
        for waiting in self._waiting.values():
            if not waiting.reply.done():
                waiting.reply.set_exception(ConnectionLost(error.message, waiting.op))
        self._waiting.clear()

    async def close(self) -> None:
        """Stop the reader, end waiting calls with :class:`~cuctxd.protos.errors.ConnectionLost`, close the socket."""
        if self._socket.closed:
            return
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.wait([self._watch])
            self._watch = None
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait([self._reader])
        self._fail(ConnectionLost("the client is closed"))
        self._socket.close()

"""The asyncio client: :class:`AsyncClient`, the :class:`~cuctxd.client.api.client.Client` API as coroutines.

Every method of :class:`~cuctxd.client.api.client.Client` is here under the same name and
arguments as a coroutine (``await client.alloc(n)``): each call is defined once for both
(:mod:`cuctxd.client.api.calls`), and :class:`~cuctxd.client.api.flavours.AsyncCall` makes it a
coroutine here that awaits :meth:`AsyncClient.run`. The objects it returns
(:class:`~cuctxd.client.api.objects.AsyncBuffer`, :class:`~cuctxd.client.api.objects.AsyncContext`,
:class:`~cuctxd.client.api.streams.AsyncStream`, :class:`~cuctxd.client.api.streams.AsyncEvent`,
:class:`~cuctxd.client.api.sharing.AsyncOpenedShare`) have coroutine methods too. The
requests are the sync client's own (:mod:`cuctxd.client.wire.build`); only the running
differs.

Open it with ``async with AsyncClient(endpoint) as client:`` (or ``client =
await AsyncClient(endpoint)`` and ``await client.close()``). Any number of tasks
of one event loop may call it at once: they share its sockets (the main one and,
as for the sync client, each device endpoint's: :mod:`cuctxd.client.wire.routes`), and replies
find their callers by request id (:mod:`cuctxd.client.wire.async_socket_transport`). With several
sockets in use, requests still leave in the order they were started, each after
what it must follow has been answered. A heartbeat task renews the lease while
the loop runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any, TypeVar

from cuctxd.client.api import calls
from cuctxd.client.api.client import HELLO_TIMEOUT, Client
from cuctxd.client.api.flavours import AsyncCall, Family
from cuctxd.client.api.objects import AsyncBuffer, AsyncContext
from cuctxd.client.api.pipeline import AsyncPipeline, raise_first
from cuctxd.client.api.sharing import AsyncOpenedShare
from cuctxd.client.api.streams import AsyncEvent, AsyncStream
from cuctxd.client.data_plane.host_buffers import AsyncHostBuffer
from cuctxd.client.data_plane.plane import DataPlane
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.presentation import docs_from
from cuctxd.client.wire import build
from cuctxd.client.wire.async_socket_transport import AsyncTransport
from cuctxd.client.wire.build import Batch, Local, Plan, Request, Run, Send, Step, Wait
from cuctxd.client.wire.lease import AsyncHeartbeat
from cuctxd.client.wire.routes import MAIN, Route, Router
from cuctxd.client.wire.session import SessionState
from cuctxd.client.wire.socket_transport import CurveKeys, KeyPath, curve_keys, daemon_watch
from cuctxd.client.wire.transport import DEFAULT_TIMEOUT, DaemonWatch, no_access, no_daemon, someone_listens
from cuctxd.protos.endpoints import client_endpoint
from cuctxd.protos.errors import ConnectionLost, CuctxError, NoDaemon, SessionClosed, UnknownSession

T = TypeVar("T")

#: The classes the async client's calls build.
FAMILY = Family(context=AsyncContext, buffer=AsyncBuffer, stream=AsyncStream, event=AsyncEvent,
                share=AsyncOpenedShare, host=AsyncHostBuffer)


@docs_from(Client)
class AsyncClient(SessionState):
    """A session with a cuctxd daemon for asyncio code; arguments as for :class:`~cuctxd.client.api.client.Client`.

    Nothing is sent until it is opened (``async with``, ``await AsyncClient(...)`` or
    :meth:`open`). It belongs to the event loop that opened it. Timeouts raise
    :class:`~cuctxd.protos.errors.DaemonTimeout`; daemon errors are the same typed
    exceptions as the sync client's, and a lost session the same
    :class:`~cuctxd.protos.errors.SessionLost` (``await client.reconnect()``).
    """

    #: The data plane, when the daemon offers this process an fd channel.
    _plane: DataPlane | None = None
    #: Whether the daemon of the session is still there: shared by all its transports.
    _watch: DaemonWatch
    data_plane = Client.data_plane  # local work: one method for both flavours

    def __init__(self, endpoint: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 hello_timeout: float = HELLO_TIMEOUT, name: str | None = None, heartbeat: bool = True,
                 server_key: KeyPath | CurveKeys | None = None, client_key: KeyPath | None = None,
                 device_endpoints: bool = True, reconnect: bool = False) -> None:
        self.endpoint = client_endpoint(endpoint)
        self.curve = curve_keys(server_key, client_key)
        self.timeout = timeout
        self.hello_timeout = hello_timeout
        self._name = name
        self._beats = heartbeat
        self._use_device_endpoints = device_endpoints
        self._reconnect = reconnect
        self._router: Router[AsyncTransport] | None = None
        self._heartbeat: AsyncHeartbeat | None = None
        #: Set once the request started last has been sent: with several sockets, requests leave in order.
        self._last_sent: asyncio.Future[None] | None = None

    async def open(self) -> AsyncClient:
        """Say hello (the session starts) and start the heartbeat; does nothing once open.
        Raises :class:`~cuctxd.protos.errors.NoDaemon` at once when nothing listens at an ipc://
        endpoint, :class:`~cuctxd.protos.errors.DaemonTimeout` when no daemon answers within
        ``hello_timeout`` (or ``timeout`` if shorter)."""
        if self._router is None:
            await self._connect()
        return self

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self.open().__await__()

    # --- plumbing -------------------------------------------------------------------

    async def _connect(self) -> None:
        """Say hello on a fresh socket: a new session."""
        denied = no_access(self.endpoint, "hello")
        if denied is not None:
            raise denied
        if not someone_listens(self.endpoint):
            raise no_daemon(self.endpoint, "hello")
        self._watch = watch = daemon_watch(self.endpoint, self.curve)
        main = AsyncTransport(self.endpoint, self.timeout, self.curve, watch=watch)
        hello = build.hello(self._name, min(self.timeout, self.hello_timeout))
        try:
            answer = hello.convert(*await main.call(hello.op, hello.args, None, timeout=hello.timeout))
        except BaseException:
            await main.close()  # not open: a later open() may try again
            watch.close()
            raise
        watch.expect(answer.get("instance"))
        self._router = Router(main, self._adopt(answer, self._use_device_endpoints), self._open_socket)
        self._plane = DataPlane.offered(answer, self.timeout)
        if self._beats:
            self._heartbeat = AsyncHeartbeat(self.endpoint, answer["session"], self.lease_ttl, self.curve, watch)

    def _open_socket(self, endpoint: str) -> AsyncTransport:
        return AsyncTransport(endpoint, self.timeout, self.curve, daemon=self.endpoint, watch=self._watch)

    async def run(self, operation: Request[T] | Plan[T]) -> T:
        """Run one request, or every step of a plan, awaiting each (see ``Client.run``)."""
        if self._token is None:
            if self._router is None:
                raise ConnectionLost("the client is not open: use `async with AsyncClient(...)`",
                                     getattr(operation, "op", None))
            if self._check_session(getattr(operation, "op", None)):
                await self.reconnect()
        try:
            run = Run(operation)
            while run.step is not None:
                try:
                    result = await self._execute(run.step)
                except Exception as error:
                    run.throw(error)
                else:
                    run.resume(result)
            return run.value
        except (UnknownSession, SessionClosed, NoDaemon) as exc:
            raise self._lose(exc) from exc

    async def _execute(self, step: Step) -> Any:
        if isinstance(step, Request) and self._outbox and step.op != "stream_ordered":
            for queued in self._outbox.take():  # awaited: a task would not leave before this request
                await self._execute(queued)
        if isinstance(step, Batch):
            outcomes = await asyncio.gather(*(self._execute(request) for request in step.requests),
                                            return_exceptions=True)
            raise_first(outcomes)
            return outcomes
        if isinstance(step, Send):  # never early: this client keeps to the sockets
            return None if step.early else asyncio.ensure_future(self._execute(step.request))
        if isinstance(step, Wait):
            return await step.sent
        if isinstance(step, Local):
            return await asyncio.to_thread(step.run)
        router = self._router
        if router is None:
            raise ConnectionLost("the client is closed", step.op)
        route, transport = router.pick(step.op, step.args)
        if route.via == MAIN and not router.device_sockets:  # one socket: it keeps the order itself
            result, frames = await transport.call(step.op, step.args, self._token, step.payload,
                                                  into=step.into, timeout=step.timeout)
            return step.convert(result, frames)
        previous, mine = self._last_sent, asyncio.get_running_loop().create_future()
        self._last_sent = mine

        async def in_turn() -> None:
            """After the request started before this one has left, and what this one must follow is answered."""
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            await self._after_conflicts(router, route)

        def sent() -> None:
            if not mine.done():
                mine.set_result(None)

        try:
            result, frames = await transport.call(step.op, step.args, self._token, step.payload, into=step.into,
                                                  timeout=step.timeout, reach=route.reach, before=in_turn, sent=sent)
        finally:
            sent()  # also when it never left (timed out, cancelled): the next request must not wait forever
        return step.convert(result, frames)

    @staticmethod
    async def _after_conflicts(router: Router[AsyncTransport], route: Route) -> None:
        for busy in router.conflicts(route):
            assert isinstance(busy, AsyncTransport)  # this client opens no shm lanes
            await asyncio.wait([call.reply for call in busy.in_flight()])

    def pipeline(self) -> AsyncPipeline:
        """Start memory ops without awaiting each (``async with client.pipeline() as p:``)."""
        return AsyncPipeline(self.run)

    async def reconnect(self) -> None:
        await self._end_session()
        await self._connect()

    async def _end_session(self) -> None:
        if self._heartbeat is not None:
            await self._heartbeat.stop()
            self._heartbeat = None
        if self._router is None:
            return
        try:
            if self._token is not None:  # a daemon that is gone must not hold the caller for long
                await self._execute(build.goodbye(timeout=min(self.timeout, 2.0)))
        except CuctxError:
            pass  # the daemon is gone or already forgot us: nothing left to free
        finally:
            self._token = None
            if self._plane is not None:
                self._plane.close()
                self._plane = None
            for socket in self._router.sockets():
                await socket.close()
            self._watch.close()

    async def close(self) -> None:
        await self._end_session()
        self._lost = None  # closed, not lost: later calls say so
        VMM_IMPORTS.closed(self)

    async def __aenter__(self) -> AsyncClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the calls, defined in calls.py: each awaits self.run with its request or plan ----------------------

    # daemon and devices
    ping = AsyncCall(calls.ping, FAMILY)
    device_count = AsyncCall(calls.device_count, FAMILY)
    devices = AsyncCall(calls.devices, FAMILY)
    status = AsyncCall(calls.status, FAMILY)
    close_session = AsyncCall(calls.close_session, FAMILY)
    shutdown = AsyncCall(calls.shutdown, FAMILY)
    get_device = AsyncCall(calls.get_device, FAMILY)
    set_device = AsyncCall(calls.set_device, FAMILY)

    # contexts
    current_context = AsyncCall(calls.current_context, FAMILY)
    context_stack = AsyncCall(calls.context_stack, FAMILY)
    create_context = AsyncCall(calls.create_context, FAMILY)
    push_context = AsyncCall(calls.push_context, FAMILY)
    pop_context = AsyncCall(calls.pop_context, FAMILY)
    destroy_context = AsyncCall(calls.destroy_context, FAMILY)
    context_info = AsyncCall(calls.context_info, FAMILY)
    synchronize = AsyncCall(calls.synchronize, FAMILY)
    device_synchronize = AsyncCall(calls.device_synchronize, FAMILY)

    # memory
    mem_get_info = AsyncCall(calls.mem_get_info, FAMILY)
    memory_info = AsyncCall(calls.memory_info, FAMILY)
    alloc = AsyncCall(calls.alloc, FAMILY)
    free = AsyncCall(calls.free, FAMILY)
    host_alloc = AsyncCall(calls.host_alloc, FAMILY)
    fill = AsyncCall(calls.fill, FAMILY)
    write = AsyncCall(calls.write, FAMILY)
    read = AsyncCall(calls.read, FAMILY)
    read_into = AsyncCall(calls.read_into, FAMILY)
    copy = AsyncCall(calls.copy, FAMILY)

    # streams and events
    create_stream = AsyncCall(calls.create_stream, FAMILY)
    create_event = AsyncCall(calls.create_event, FAMILY)

    # sharing between processes
    export = AsyncCall(calls.export, FAMILY)
    publish = AsyncCall(calls.publish, FAMILY)
    unpublish = AsyncCall(calls.unpublish, FAMILY)
    lookup = AsyncCall(calls.lookup, FAMILY)
    wait_version = AsyncCall(calls.wait_version, FAMILY)
    verify_shared = AsyncCall(calls.verify_shared, FAMILY)
    list_shared = AsyncCall(calls.list_shared, FAMILY)
    shared_page = AsyncCall(calls.shared_page, FAMILY)
    open_shared = AsyncCall(calls.open_shared, FAMILY)
    close_shared = AsyncCall(calls.close_shared, FAMILY)
    revoke = AsyncCall(calls.revoke, FAMILY)

    # --- the stream-ordered outbox: queued here, sent before the next request ---------------------------

    async def alloc_async(self, size: int, device: int | None = None, *,
                          stream: AsyncStream | None = None) -> AsyncBuffer:
        """Like ``Client.alloc_async`` (nothing is sent yet: awaiting it never waits). The queued entries
        go out, and are waited for, before this client's next request."""
        if self._router is None:
            raise ConnectionLost("the client is not open: use `async with AsyncClient(...)`", "stream_ordered")
        if device is None:
            device = self._router.routes.current_device if stream is None else stream.device
        return AsyncBuffer(self, self._outbox.alloc(device, size, None if stream is None else stream.handle))

    async def free_async(self, buffer: AsyncBuffer, *, stream: AsyncStream | None = None) -> None:
        """Like ``Client.free_async`` (nothing is sent yet)."""
        if not buffer.freed:
            buffer.freed = True
            self._outbox.free(buffer.device, buffer.handle, None if stream is None else stream.handle)

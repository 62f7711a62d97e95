"""The asyncio client: :class:`AsyncClient`, the :class:`~cuctxd.client.api.client.Client` API as coroutines.

Every method of :class:`~cuctxd.client.api.client.Client` is here under the same name and
arguments as a coroutine (``await client.alloc(n)``), and the objects it returns
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
import time
from collections.abc import Generator
from typing import Any, TypeVar

from cuctxd.client.api.client import HELLO_TIMEOUT, Client
from cuctxd.client.api.objects import AsyncBuffer, AsyncContext
from cuctxd.client.api.pipeline import AsyncPipeline, raise_first
from cuctxd.client.api.sharing import AsyncOpenedShare, open_share
from cuctxd.client.api.streams import AsyncEvent, AsyncStream
from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.host_buffers import AsyncHostBuffer, host_alloc
from cuctxd.client.data_plane.plane import DataPlane
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.presentation import docs_from
from cuctxd.client.wire import build
from cuctxd.client.wire.async_socket_transport import AsyncTransport
from cuctxd.client.wire.build import Batch, Local, Plan, Request, Run, Send, SharedPage, Step, Wait
from cuctxd.client.wire.lease import AsyncHeartbeat
from cuctxd.client.wire.routes import MAIN, Route, Router
from cuctxd.client.wire.session import SessionState
from cuctxd.client.wire.socket_transport import CurveKeys, KeyPath, curve_keys, daemon_watch
from cuctxd.client.wire.transport import DEFAULT_TIMEOUT, DaemonWatch, no_access, no_daemon, someone_listens
from cuctxd.protos.endpoints import client_endpoint
from cuctxd.protos.errors import ConnectionLost, CuctxError, NoDaemon, SessionClosed, UnknownSession
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

T = TypeVar("T")


@docs_from(Client)
class AsyncClient(SessionState):
    """A session with a cuctxd daemon for asyncio code; arguments as for :class:`~cuctxd.client.api.client.Client`.

    Nothing is sent until it is opened (``async with``, ``await AsyncClient(...)`` or
    :meth:`open`). It belongs to the event loop that opened it. Timeouts raise
    :class:`~cuctxd.protos.errors.DaemonTimeout`; daemon errors are the same typed
    exceptions as the sync client's, and a lost session the same
    :class:`~cuctxd.protos.errors.SessionLost` (``await client.reconnect()``).
    """

    #: What ``host_alloc`` (and a staging ring) makes.
    host_buffer_kind = AsyncHostBuffer
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

    # --- daemon and devices -----------------------------------------------------------

    async def ping(self) -> float:
        start = time.perf_counter()
        await self.run(build.ping())
        return time.perf_counter() - start

    async def device_count(self) -> int:
        return await self.run(build.device_count())

    async def devices(self) -> list[DeviceInfo]:
        return await self.run(build.devices())

    async def status(self) -> dict[str, Any]:
        return await self.run(build.status())

    async def close_session(self, session_id: int) -> None:
        await self.run(build.close_session(session_id))

    async def shutdown(self) -> None:
        await self.run(build.shutdown())

    async def get_device(self) -> int:
        return await self.run(build.get_device())

    async def set_device(self, device: int) -> AsyncContext:
        return await self.run(build.set_device(self, AsyncContext, device))

    # --- contexts -------------------------------------------------------------------

    async def current_context(self, device: int | None = None) -> AsyncContext | None:
        return await self.run(build.current_context(self, AsyncContext, device))

    async def context_stack(self, device: int | None = None) -> list[AsyncContext]:
        return await self.run(build.context_stack(self, AsyncContext, device))

    async def create_context(self, device: int | None = None, flags: int = 0) -> AsyncContext:
        return await self.run(build.create_context(self, AsyncContext, device, flags))

    async def push_context(self, context: AsyncContext) -> None:
        await self.run(build.push_context(context))

    async def pop_context(self, device: int | None = None) -> AsyncContext:
        return await self.run(build.pop_context(self, AsyncContext, device))

    async def destroy_context(self, context: AsyncContext) -> None:
        await self.run(build.destroy_context(context))

    async def context_info(self, context: AsyncContext) -> AsyncContext:
        return await self.run(build.context_info(self, AsyncContext, context))

    async def synchronize(self, device: int | None = None) -> None:
        await self.run(build.synchronize(device))

    async def device_synchronize(self, device: int | None = None) -> None:
        await self.run(build.device_synchronize(device))

    # --- memory ---------------------------------------------------------------------

    async def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        return await self.run(build.mem_get_info(device))

    async def memory_info(self, device: int | None = None) -> dict[str, Any]:
        return await self.run(build.memory_info(device))

    async def alloc(self, size: int, device: int | None = None, *, shareable: bool = False) -> AsyncBuffer:
        return await self.run(build.alloc(self, AsyncBuffer, size, device, shareable))

    async def free(self, buffer: AsyncBuffer) -> None:
        await self.run(build.free(buffer))

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

    async def host_alloc(self, size: int, device: int | None = None, *, reuse: bool = False) -> AsyncHostBuffer:
        """Host memory shared with the daemon and page-locked there, for copies with ``device``'s buffers
        (default: the current device) that carry no bytes on the socket; needs the fd channel (ipc://).
        Counts against the session's ``host_memory_per_session``; :meth:`AsyncHostBuffer.free` gives it back.
        ``reuse``: a buffer of the same size the daemon kept page-locked after a session of this user freed it
        may serve (no new page-locking: 0.5 ms a MiB), its bytes as that session left them."""
        return await self.run(host_alloc(self, AsyncHostBuffer, size, device, reuse))

    async def fill(self, buffer: AsyncBuffer, value: int = 0, offset: int = 0, size: int | None = None, *,
                   stream: AsyncStream | None = None) -> None:
        await self.run(build.fill(buffer, value, offset, size, stream))

    async def write(self, buffer: AsyncBuffer, data: Any, offset: int = 0, *,
                    stream: AsyncStream | None = None) -> int:
        return await self.run(transfers.write(self, buffer, data, offset, stream))

    async def read(self, buffer: AsyncBuffer, size: int | None = None, offset: int = 0, *,
                   stream: AsyncStream | None = None) -> bytes:
        return await self.run(transfers.read(self, buffer, size, offset, stream))

    async def read_into(self, buffer: AsyncBuffer, out: Any, offset: int = 0, *,
                        stream: AsyncStream | None = None) -> int:
        return await self.run(transfers.read_into(self, buffer, out, offset, stream))

    async def copy(self, src: AsyncBuffer, dst: AsyncBuffer, size: int | None = None, src_offset: int = 0,
                   dst_offset: int = 0, *, stream: AsyncStream | None = None) -> int:
        return await self.run(build.copy(src, dst, size, src_offset, dst_offset, stream))

    # --- streams and events -----------------------------------------------------------------

    async def create_stream(self, device: int | None = None, *, non_blocking: bool = False) -> AsyncStream:
        return await self.run(build.create_stream(self, AsyncStream, device, non_blocking))

    async def create_event(self, device: int | None = None, *, timing: bool = True) -> AsyncEvent:
        return await self.run(build.create_event(self, AsyncEvent, device, timing))

    # --- sharing between processes --------------------------------------------------------

    async def export(self, buffer: AsyncBuffer) -> ShareDescriptor:
        return await self.run(build.export(buffer))

    async def publish(self, buffer: AsyncBuffer, name: str, *, persistent: bool = False, once: bool = False,
                      read_only: bool = False, replace: bool = False, version: bool = False) -> ShareDescriptor:
        return await self.run(build.publish(buffer, name, persistent=persistent, read_only=read_only, once=once,
                                            replace=replace, version=version))

    async def unpublish(self, name: str, *, device: int | None = None) -> None:
        await self.run(build.unpublish(name, device))

    async def lookup(self, name: str, *, digest: str | None = None, device: int | None = None,
                     version: int | None = None) -> ShareDescriptor:
        """As :meth:`cuctxd.client.api.client.Client.lookup`."""
        return await self.run(build.lookup(name, device, version) if digest is None
                              else build.lookup_verified(name, digest, device))

    async def wait_version(self, name: str, after: int, timeout: float | None = None) -> int:
        """As :meth:`cuctxd.client.api.client.Client.wait_version`; other calls of this client go on meanwhile."""
        return await self.run(build.wait_version(name, after, timeout))

    async def verify_shared(self, name: str, digest: str, device: int) -> dict[str, Any]:
        """As :meth:`cuctxd.client.api.client.Client.verify_shared`."""
        return await self.run(build.verify_shared(name, digest, device))

    async def list_shared(self, *, prefix: str | None = None, owner: int | None = None,
                          uid: int | None = None) -> list[dict[str, Any]]:
        return await self.run(build.list_shared(prefix, owner, uid))

    async def shared_page(self, *, limit: int | None = None, after: str | None = None, prefix: str | None = None,
                          owner: int | None = None, uid: int | None = None) -> SharedPage:
        return await self.run(build.shared_page(limit, after, prefix, owner, uid))

    async def open_shared(self, share: str | ShareDescriptor) -> AsyncOpenedShare:
        """Hold a share (by name or descriptor) and map it in this process (mapping is local,
        synchronous work); ``await share.close()`` or ``async with`` drops the hold."""
        return await self.run(open_share(self, AsyncOpenedShare, share))

    async def close_shared(self, descriptor: ShareDescriptor) -> None:
        await self.run(build.close_shared(descriptor))

    async def revoke(self, share: AsyncBuffer | ShareDescriptor) -> None:
        if isinstance(share, ShareDescriptor):
            await self.run(build.revoke(share))
        else:
            await self.run(build.revoke_buffer(share))

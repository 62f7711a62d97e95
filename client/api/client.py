"""The synchronous client: one session with the daemon, with CUDA's names and semantics.

A new :class:`Client` is like a new CUDA host thread: no current context on any
device until :meth:`Client.set_device`, :meth:`Client.create_context`, or a
runtime-style call (``alloc``, ``synchronize``, ``mem_get_info`` ...) binds the
device's primary context. Calls are thread-safe (serialised per socket).
Each call is defined once, for both clients, in :mod:`cuctxd.client.api.calls`
(:class:`~cuctxd.client.api.flavours.SyncCall` makes it a method here that runs its
request or plan with :meth:`Client.run`); written here are how a request is sent and
waited for, and the calls that are not one request or plan.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, overload

from cuctxd.client.api import calls
from cuctxd.client.api.flavours import Family, SyncCall
from cuctxd.client.api.objects import Buffer, Context
from cuctxd.client.api.pipeline import Pipeline
from cuctxd.client.api.sharing import OpenedShare
from cuctxd.client.api.streams import Event, Stream
from cuctxd.client.data_plane.host_buffers import HostBuffer
from cuctxd.client.data_plane.plane import DataPlane, checked
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.wire import build
from cuctxd.client.wire.build import CHUNK_BYTES, Batch, Plan, Request, Run, Send, Step, Wait
from cuctxd.client.wire.lease import Heartbeat
from cuctxd.client.wire.routes import Router
from cuctxd.client.wire.session import SessionState
from cuctxd.client.wire.shm_lane import ShmTransport
from cuctxd.client.wire.socket_transport import CurveKeys, KeyPath, Transport, curve_keys, daemon_watch
from cuctxd.client.wire.transport import DEFAULT_TIMEOUT, Call, DaemonWatch, no_access, no_daemon, someone_listens
from cuctxd.protos.endpoints import client_endpoint
from cuctxd.protos.errors import CuctxError, NoDaemon, SessionClosed, UnknownSession

__all__ = ["CHUNK_BYTES", "HELLO_TIMEOUT", "Client"]

T = TypeVar("T")

#: Seconds the handshake (``hello``) waits at most, whatever the per-call ``timeout``: a daemon that
#: is there answers it at once, so a long wait only hides a wrong endpoint or key.
HELLO_TIMEOUT = 5.0

#: The classes the sync client's calls build.
FAMILY = Family(context=Context, buffer=Buffer, stream=Stream, event=Event, share=OpenedShare, host=HostBuffer)


def _wait_out(transports: Iterable[Any]) -> None:
    """Wait for every call these transports (sockets or shm lanes) have in flight (under the route lock)."""
    for transport in transports:
        for call in transport.in_flight():
            transport.wait(call)


class Client(SessionState):
    """A session with a cuctxd daemon.

    ``endpoint``: the argument, else ``$CUCTXD_ENDPOINT``, else the per-user
    default ipc:// socket. When nothing listens at an ipc:// endpoint the client
    raises :class:`~cuctxd.protos.errors.NoDaemon` at once, also while a call waits
    (checked every second). ``timeout``: seconds any call waits before raising
    :class:`~cuctxd.protos.errors.DaemonTimeout`; the handshake waits at most
    ``hello_timeout``. Use as a context manager, or call :meth:`close`, so the
    daemon frees the session's contexts and memory. A background thread renews the
    session's lease; ``heartbeat=False`` turns it off (the session then ends
    ``lease_ttl`` seconds after its last call).

    When the daemon stops, or restarts and no longer knows the session, calls raise
    :class:`~cuctxd.protos.errors.SessionLost` (the session's objects are gone) until
    :meth:`reconnect` starts a new session; with ``reconnect=True`` the next call
    after that error does so by itself. The default is not to: a new, empty session
    silently put in place of the old one would leave the caller's handles naming
    nothing. Shares mapped before a restart stay mapped; names the new daemon
    re-adopted open as before in the new session. ``instance`` is the daemon run's
    id from ``hello``; ``restarted`` says whether it differs from the previous
    session's (a reconnect after a restart).

    CURVE (a daemon with ``server_key``): ``server_key`` is the daemon's public
    key file (``server.key``), ``client_key`` this client's secret key file
    (``NAME.key_secret`` from ``cuctxd keygen``), whose public half must be in
    the daemon's ``allow_dir``. A daemon refusing the keys never answers, so a
    key problem shows as :class:`~cuctxd.protos.errors.DaemonTimeout` saying so. A bad
    key file raises ValueError at once.

    Device ops go straight to each device's own endpoint when the daemon offers
    them, and small ones through an shm lane when the client has the fd channel
    (:mod:`cuctxd.client.wire.routes`); ``device_endpoints=False`` sends everything
    through the main endpoint.
    """

    #: The data plane, when the daemon offers this process an fd channel.
    _plane: DataPlane | None = None
    #: Whether the daemon of the session is still there: shared by all its transports.
    _watch: DaemonWatch

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
        self._route_lock = threading.RLock()
        self._heartbeat: Heartbeat | None = None
        self._connect()

    # --- plumbing -------------------------------------------------------------------

    def _connect(self) -> None:
        """Say hello on a fresh socket: a new session."""
        denied = no_access(self.endpoint, "hello")
        if denied is not None:
            raise denied
        if not someone_listens(self.endpoint):
            raise no_daemon(self.endpoint, "hello")
        self._watch = watch = daemon_watch(self.endpoint, self.curve)
        main = Transport(self.endpoint, self.timeout, self.curve, watch=watch)
        hello = build.hello(self._name, min(self.timeout, self.hello_timeout))
        try:
            answer = main.send(hello.op, hello.args, None, convert=hello.convert).result(hello.timeout)
        except BaseException:
            main.close()
            watch.close()
            raise
        watch.expect(answer.get("instance"))
        endpoints = self._adopt(answer, self._use_device_endpoints)
        self._plane = DataPlane.offered(answer, self.timeout)
        # shm lanes are admitted by the device endpoints' workers: only with those and a data plane
        open_shm = self._open_shm if self._plane is not None and endpoints else None
        self._router: Router[Transport] = Router(main, endpoints, self._open_socket, open_shm)
        if self._beats:
            self._heartbeat = Heartbeat(self.endpoint, answer["session"], self.lease_ttl, self.curve, watch)

    def _open_socket(self, endpoint: str) -> Transport:
        return Transport(endpoint, self.timeout, self.curve, daemon=self.endpoint, watch=self._watch)

    def _open_shm(self, device: int) -> ShmTransport | None:
        """The shm lane to ``device`` (under the route lock), or None when the daemon or this process
        cannot give one: its requests then take the socket."""
        assert self._plane is not None
        request = build.shm_lane(device)
        try:
            opened = self._send_now(request).result()
            fds, _ = self._plane.channel.fetch(opened["ticket"])
        except (CuctxError, OSError):
            return None
        if len(fds) not in (3, 4):  # the region, two eventfds, and the daemon's pidfd where it has one
            for fd in fds:
                os.close(fd)
            return None
        _, socket = self._router.pick(request.op, request.args)  # where its requests go once it is closed
        return ShmTransport(fds, self._watch, self.timeout, socket)

    @property
    def shm_lanes(self) -> tuple[int, ...]:
        """The devices this session's shm lanes reach (PROTOCOL.md, "The shm lane"): each opened on the
        session's first single device call there, when the client has the fd channel."""
        shm = self._router.shm
        return () if shm is None else shm.devices()

    def run(self, operation: Request[T] | Plan[T]) -> T:
        """Run one request, or every step of a plan, built by :mod:`cuctxd.client.wire.build`, on this thread;
        every method and client object comes here. A session found gone raises
        :class:`~cuctxd.protos.errors.SessionLost`."""
        if self._token is None and self._check_session(getattr(operation, "op", None)):
            self.reconnect()
        try:
            if isinstance(operation, Request):  # the common case, without a plan's generator
                return self._send(operation).result(operation.timeout)
            run = Run(operation)
            while run.step is not None:
                try:
                    result = self._execute(run.step)
                except BaseException as error:  # a KeyboardInterrupt too: the plan's cleanup steps still run
                    run.throw(error)
                else:
                    run.resume(result)
            return run.value
        except (UnknownSession, SessionClosed, NoDaemon) as exc:
            raise self._lose(exc) from exc

    def _execute(self, step: Step) -> Any:
        if isinstance(step, Request):
            return self._send(step).result(step.timeout)
        if isinstance(step, Batch):
            with self.pipeline() as batch:
                calls = [batch.send(request) for request in step.requests]
            return [call.result() for call in calls]
        if isinstance(step, Send):
            return self._send_early(step.request) if step.early else self._send(step.request, shm=not step.many)
        if isinstance(step, Wait):
            return step.sent.result()
        return step.run()

    def _send(self, request: Request[T], shm: bool = True) -> Call[T]:
        """Send on the request's route (:meth:`_dispatch`); queued stream-ordered entries go first, without
        waiting for their replies. ``shm``: the shm lane may carry it (a pipeline's requests take the socket,
        which has room for many at once)."""
        with self._route_lock:
            self._flush_outbox()
            return self._send_now(request, shm)

    def _flush_outbox(self) -> None:
        """Send the queued stream-ordered entries without waiting (under the route lock)."""
        for queued in self._outbox.take():
            self._send_now(queued)

    def _send_now(self, request: Request[T], shm: bool = True) -> Call[T]:
        call = self._dispatch(request, shm, early=False)
        assert call is not None  # only an early request can be left unsent
        return call

    def _send_early(self, request: Request[T]) -> Call[T] | None:
        """Send early on the shm lane the request may take (PROTOCOL.md, "Early requests"); None when
        there is none."""
        with self._route_lock:
            self._flush_outbox()
            return self._dispatch(request, True, early=True)

    def _dispatch(self, request: Request[T], shm: bool, early: bool) -> Call[T] | None:
        """Send ``request`` on the transport its route picks (:meth:`Router.pick
        <cuctxd.client.wire.routes.Router.pick>`), once the calls in flight on other transports that it must
        follow have been answered. ``shm``: its shm lane may carry it; one it does not fit sends it on the
        socket. ``early``: only an shm lane may (None when it cannot)."""
        with self._route_lock:
            router = self._router
            route, transport = router.pick(request.op, request.args, shm=shm)
            if isinstance(transport, ShmTransport):
                _wait_out(router.conflicts(route))
                call = transport.try_send(request.op, request.args, self._token, request.payload,
                                          into=request.into, convert=request.convert, reach=route.reach,
                                          early=early)
                if call is not None or early:
                    return call
                route, transport = router.socket(route)
            elif early:
                return None
            _wait_out(router.conflicts(route))
            return transport.send(request.op, request.args, self._token, request.payload, into=request.into,
                                  convert=request.convert, reach=route.reach)

    @overload
    def data_plane(self, *, required: Literal[True] = True) -> DataPlane: ...

    @overload
    def data_plane(self, *, required: bool) -> DataPlane | None: ...

    def data_plane(self, *, required: bool = True) -> DataPlane | None:
        """The client's data plane (:mod:`cuctxd.client.data_plane.plane`); without one (no fd channel: tcp://,
        another host) None, or :class:`~cuctxd.protos.errors.NotShareable` when ``required``."""
        return checked(self._plane, self.endpoint, required)

    def pipeline(self) -> Pipeline:
        """Send memory ops without waiting for each reply (see :mod:`cuctxd.client.api.pipeline`)."""
        return Pipeline(lambda request: self._send(request, shm=False))

    def reconnect(self) -> None:
        """Start a new session on this client, on fresh sockets: after
        :class:`~cuctxd.protos.errors.SessionLost`, or to drop all the session holds. Objects of the
        old session must not be used again (their handles mean nothing, or something else, in the new
        one). Raises :class:`~cuctxd.protos.errors.NoDaemon` or ``DaemonTimeout`` while no daemon answers."""
        with self._route_lock:
            self._end_session()
            self._connect()

    def _end_session(self) -> None:
        """Say goodbye if the session is alive, and close the sockets."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        try:
            if self._token is not None:  # a daemon that is gone must not hold the caller for long
                goodbye = build.goodbye(timeout=min(self.timeout, 2.0))
                self._send(goodbye).result(goodbye.timeout)
        except CuctxError:
            pass  # the daemon is gone or already forgot us: nothing left to free
        finally:
            self._token = None
            if self._router.shm is not None:
                self._router.shm.close()
            if self._plane is not None:
                self._plane.close()
                self._plane = None
            for socket in self._router.sockets():
                socket.close()
            self._watch.close()

    def close(self) -> None:
        """End the session (the daemon frees its contexts and memory) and the connection."""
        self._end_session()
        self._lost = None  # closed, not lost: later calls say so
        VMM_IMPORTS.closed(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the calls, defined in calls.py: each runs its request or plan with self.run -----------------------

    # daemon and devices
    ping = SyncCall(calls.ping, FAMILY)
    device_count = SyncCall(calls.device_count, FAMILY)
    devices = SyncCall(calls.devices, FAMILY)
    status = SyncCall(calls.status, FAMILY)
    close_session = SyncCall(calls.close_session, FAMILY)
    shutdown = SyncCall(calls.shutdown, FAMILY)
    get_device = SyncCall(calls.get_device, FAMILY)
    set_device = SyncCall(calls.set_device, FAMILY)

    # contexts
    current_context = SyncCall(calls.current_context, FAMILY)
    context_stack = SyncCall(calls.context_stack, FAMILY)
    create_context = SyncCall(calls.create_context, FAMILY)
    push_context = SyncCall(calls.push_context, FAMILY)
    pop_context = SyncCall(calls.pop_context, FAMILY)
    destroy_context = SyncCall(calls.destroy_context, FAMILY)
    context_info = SyncCall(calls.context_info, FAMILY)
    synchronize = SyncCall(calls.synchronize, FAMILY)
    device_synchronize = SyncCall(calls.device_synchronize, FAMILY)

    # memory
    mem_get_info = SyncCall(calls.mem_get_info, FAMILY)
    memory_info = SyncCall(calls.memory_info, FAMILY)
    alloc = SyncCall(calls.alloc, FAMILY)
    free = SyncCall(calls.free, FAMILY)
    host_alloc = SyncCall(calls.host_alloc, FAMILY)
    fill = SyncCall(calls.fill, FAMILY)
    write = SyncCall(calls.write, FAMILY)
    read = SyncCall(calls.read, FAMILY)
    read_into = SyncCall(calls.read_into, FAMILY)
    copy = SyncCall(calls.copy, FAMILY)

    # streams and events
    create_stream = SyncCall(calls.create_stream, FAMILY)
    create_event = SyncCall(calls.create_event, FAMILY)

    # sharing between processes
    export = SyncCall(calls.export, FAMILY)
    publish = SyncCall(calls.publish, FAMILY)
    unpublish = SyncCall(calls.unpublish, FAMILY)
    lookup = SyncCall(calls.lookup, FAMILY)
    wait_version = SyncCall(calls.wait_version, FAMILY)
    verify_shared = SyncCall(calls.verify_shared, FAMILY)
    list_shared = SyncCall(calls.list_shared, FAMILY)
    shared_page = SyncCall(calls.shared_page, FAMILY)
    open_shared = SyncCall(calls.open_shared, FAMILY)
    close_shared = SyncCall(calls.close_shared, FAMILY)
    revoke = SyncCall(calls.revoke, FAMILY)

    # --- the stream-ordered outbox: queued here, sent before the next request ---------------------------

    def alloc_async(self, size: int, device: int | None = None, *, stream: Stream | None = None) -> Buffer:
        """Like ``cuMemAllocAsync``: pool memory ordered on ``stream`` (default: the legacy stream of the
        current context), returned at once without a round trip (:mod:`cuctxd.client.wire.stream_ordered`). A
        failure is raised by the next call that uses the buffer, or by the next synchronize; the
        buffer's ``context`` reads 0."""
        with self._route_lock:
            if device is None:
                device = self._router.routes.current_device if stream is None else stream.device
            record = self._outbox.alloc(device, size, None if stream is None else stream.handle)
            if self._outbox.full():
                self._flush_outbox()
        return Buffer(self, record)

    def free_async(self, buffer: Buffer, *, stream: Stream | None = None) -> None:
        """Like ``cuMemFreeAsync``: queued without a round trip, in order on ``stream``; nothing if freed."""
        with self._route_lock:
            if buffer.freed:
                return
            buffer.freed = True
            self._outbox.free(buffer.device, buffer.handle, None if stream is None else stream.handle)
            if self._outbox.full():
                self._flush_outbox()

"""The synchronous client: one session with the daemon, with CUDA's names and semantics.

A new :class:`Client` is like a new CUDA host thread: no current context on any
device until :meth:`Client.set_device`, :meth:`Client.create_context`, or a
runtime-style call (``alloc``, ``synchronize``, ``mem_get_info`` ...) binds the
device's primary context. Calls are thread-safe (serialised per socket).
Each method builds its request (or plan) in :mod:`cuctxd.client.wire.build` and runs it
here; :class:`~cuctxd.client.api.async_client.AsyncClient` awaits the very same ones.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeVar

from cuctxd.client.api.objects import Buffer, Context
from cuctxd.client.api.pipeline import Pipeline
from cuctxd.client.api.sharing import OpenedShare, open_share
from cuctxd.client.api.streams import Event, Stream
from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.host_buffers import HostBuffer, host_alloc
from cuctxd.client.data_plane.plane import DataPlane, checked
from cuctxd.client.data_plane.vmm_imports import VMM_IMPORTS
from cuctxd.client.wire import build
from cuctxd.client.wire.build import CHUNK_BYTES, Batch, Plan, Request, Run, Send, SharedPage, Step, Wait
from cuctxd.client.wire.lease import Heartbeat
from cuctxd.client.wire.routes import Router
from cuctxd.client.wire.session import SessionState
from cuctxd.client.wire.shm_lane import ShmTransport
from cuctxd.client.wire.socket_transport import CurveKeys, KeyPath, Transport, curve_keys, daemon_watch
from cuctxd.client.wire.transport import DEFAULT_TIMEOUT, Call, DaemonWatch, no_access, no_daemon, someone_listens
from cuctxd.protos.endpoints import client_endpoint
from cuctxd.protos.errors import CuctxError, NoDaemon, SessionClosed, UnknownSession
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

__all__ = ["CHUNK_BYTES", "HELLO_TIMEOUT", "Client"]

T = TypeVar("T")

#: Seconds the handshake (``hello``) waits at most, whatever the per-call ``timeout``: a daemon that
#: is there answers it at once, so a long wait only hides a wrong endpoint or key.
HELLO_TIMEOUT = 5.0


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

    #: What ``host_alloc`` (and a staging ring) makes.
    host_buffer_kind = HostBuffer
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

    # --- daemon and devices -----------------------------------------------------------

    def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self.run(build.ping())
        return time.perf_counter() - start

    def device_count(self) -> int:
        """``cudaGetDeviceCount``: creates no context."""
        return self.run(build.device_count())

    def devices(self) -> list[DeviceInfo]:
        return self.run(build.devices())

    def status(self) -> dict[str, Any]:
        return self.run(build.status())

    def close_session(self, session_id: int) -> None:
        """Close the session ``session_id`` (its public id, as ``status`` lists it) as its ``goodbye``
        would: allowed to that session's user and the daemon's own user."""
        self.run(build.close_session(session_id))

    def shutdown(self) -> None:
        """Ask the daemon to shut down as SIGTERM does (drain, then exit): only its own user may."""
        self.run(build.shutdown())

    def get_device(self) -> int:
        """``cudaGetDevice``: the session's current device."""
        return self.run(build.get_device())

    def set_device(self, device: int) -> Context:
        """``cudaSetDevice``: binds the device's primary context as current; returns it."""
        return self.run(build.set_device(self, Context, device))

    # --- contexts -------------------------------------------------------------------

    def current_context(self, device: int | None = None) -> Context | None:
        """``cuCtxGetCurrent``; None while the session's stack on ``device`` is empty."""
        return self.run(build.current_context(self, Context, device))

    def context_stack(self, device: int | None = None) -> list[Context]:
        """The session's context stack on ``device``, bottom first."""
        return self.run(build.context_stack(self, Context, device))

    def create_context(self, device: int | None = None, flags: int = 0) -> Context:
        """``cuCtxCreate``: a new context, pushed and current on ``device``."""
        return self.run(build.create_context(self, Context, device, flags))

    def push_context(self, context: Context) -> None:
        self.run(build.push_context(context))

    def pop_context(self, device: int | None = None) -> Context:
        """``cuCtxPopCurrent``: returns the popped context."""
        return self.run(build.pop_context(self, Context, device))

    def destroy_context(self, context: Context) -> None:
        self.run(build.destroy_context(context))

    def context_info(self, context: Context) -> Context:
        return self.run(build.context_info(self, Context, context))

    def synchronize(self, device: int | None = None) -> None:
        """``cuCtxSynchronize`` on the current context (binds the primary if there is none)."""
        self.run(build.synchronize(device))

    def device_synchronize(self, device: int | None = None) -> None:
        """Wait for every context alive on ``device``, this session's and others'."""
        self.run(build.device_synchronize(device))

    # --- memory ---------------------------------------------------------------------

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        """``cuMemGetInfo``: (free, total) bytes."""
        return self.run(build.mem_get_info(device))

    def memory_info(self, device: int | None = None) -> dict[str, Any]:
        """The whole ``mem_get_info`` answer: ``free`` and ``total`` as this session sees them,
        plus ``device_free``, ``quota``, ``reserve`` and ``limited_by`` ("quota" or "device")."""
        return self.run(build.memory_info(device))

    def alloc(self, size: int, device: int | None = None, *, shareable: bool = False) -> Buffer:
        """Device memory in the current context of ``device`` (default: the current device).

        By default it comes from the context's stream-ordered pool (fast), never exported; pass
        ``shareable=True`` for memory other processes can open: a VMM allocation of its own, of at least
        the device's granularity (2 MiB), where the GPU has VMM (PROTOCOL.md, section 7, "Buffers").
        """
        return self.run(build.alloc(self, Buffer, size, device, shareable))

    def free(self, buffer: Buffer) -> None:
        self.run(build.free(buffer))

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

    def host_alloc(self, size: int, device: int | None = None, *, reuse: bool = False) -> HostBuffer:
        """Host memory shared with the daemon and page-locked there, for copies with ``device``'s buffers
        (default: the current device) that carry no bytes on the socket; needs the fd channel (ipc://).
        Counts against the session's ``host_memory_per_session``; :meth:`HostBuffer.free` gives it back.
        ``reuse``: a buffer of the same size the daemon kept page-locked after a session of this user freed it
        may serve (no new page-locking: 0.5 ms a MiB), its bytes as that session left them."""
        return self.run(host_alloc(self, HostBuffer, size, device, reuse))

    def fill(self, buffer: Buffer, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: Stream | None = None) -> None:
        self.run(build.fill(buffer, value, offset, size, stream))

    def write(self, buffer: Buffer, data: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Host to device. Large writes go as pipelined chunks, so the transfer of one chunk
        overlaps the device copy of the one before."""
        return self.run(transfers.write(self, buffer, data, offset, stream))

    def read(self, buffer: Buffer, size: int | None = None, offset: int = 0, *,
             stream: Stream | None = None) -> bytes:
        return self.run(transfers.read(self, buffer, size, offset, stream))

    def read_into(self, buffer: Buffer, out: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Device to host straight into ``out`` (``recv_into``), in pipelined chunks when large."""
        return self.run(transfers.read_into(self, buffer, out, offset, stream))

    def copy(self, src: Buffer, dst: Buffer, size: int | None = None, src_offset: int = 0,
             dst_offset: int = 0, *, stream: Stream | None = None) -> int:
        return self.run(build.copy(src, dst, size, src_offset, dst_offset, stream))

    # --- streams and events -----------------------------------------------------------------

    def create_stream(self, device: int | None = None, *, non_blocking: bool = False) -> Stream:
        """``cuStreamCreate`` in the current context of ``device`` (binds the primary lazily)."""
        return self.run(build.create_stream(self, Stream, device, non_blocking))

    def create_event(self, device: int | None = None, *, timing: bool = True) -> Event:
        return self.run(build.create_event(self, Event, device, timing))

    # --- sharing between processes --------------------------------------------------------

    def export(self, buffer: Buffer) -> ShareDescriptor:
        """Make ``buffer`` shareable; the descriptor is plain data another process can open."""
        return self.run(build.export(buffer))

    def publish(self, buffer: Buffer, name: str, *, persistent: bool = False, once: bool = False,
                read_only: bool = False, replace: bool = False, version: bool = False) -> ShareDescriptor:
        """Export ``buffer`` and publish it under ``name`` for every session to look up. The name keeps the
        buffer until it is unpublished or, once this session let the buffer go and nobody holds it, the
        daemon's ``orphan_ttl`` passes; ``persistent``: no ``orphan_ttl`` (and the name survives a daemon
        restart where a service manager keeps it); ``once``: consume-once, the name stops keeping the
        buffer once a session opened it after its owner let go (PROTOCOL.md, "Lifetime of shared memory");
        ``read_only``: openers map it without write access (advisory: section 9 of PROTOCOL.md says where
        it holds); ``replace``: a name in use moves to ``buffer`` at once, if this session may unpublish it
        (sessions holding the old buffer keep it); ``version``: the name's next version (its number in the
        descriptor's ``version``), handed to the name: ``buffer`` counts as freed here (PROTOCOL.md, "Versions")."""
        return self.run(build.publish(buffer, name, persistent=persistent, read_only=read_only, once=once,
                                      replace=replace, version=version))

    def unpublish(self, name: str, *, device: int | None = None) -> None:
        """Remove a name published by this user's sessions (any name, as the daemon's own user): every copy of it,
        or with ``device`` only its copy there."""
        self.run(build.unpublish(name, device))

    def lookup(self, name: str, *, digest: str | None = None, device: int | None = None,
               version: int | None = None) -> ShareDescriptor:
        """The descriptor published as ``name`` (its copy on ``device``; else its first); with ``digest``, only once
        the daemon vouches that the name's layout has that digest (:meth:`verify_shared`):
        :class:`~cuctxd.protos.errors.DigestMismatch` otherwise; ``version``: that live version of a versioned
        name instead of its current one."""
        return self.run(build.lookup(name, device, version) if digest is None
                        else build.lookup_verified(name, digest, device))

    def wait_version(self, name: str, after: int, timeout: float | None = None) -> int:
        """Block until ``name`` has a version newer than ``after`` and return its number: the daemon answers
        when it is published (no polling here); :class:`~cuctxd.protos.errors.TimedOut` (a TimeoutError) after
        ``timeout`` seconds. Other calls of this client wait meanwhile: wait on a client of its own."""
        return self.run(build.wait_version(name, after, timeout))

    def verify_shared(self, name: str, digest: str, device: int) -> dict[str, Any]:
        """Have the daemon vouch for ``name``'s layout digest on ``device`` before relying on it: at once for a
        name of this user's, else once it hashed the bytes (the first reliance only). Returns ``digest``,
        ``verified`` (``"publisher"`` or ``"daemon"``) and ``hashed``; raises
        :class:`~cuctxd.protos.errors.DigestMismatch` for another digest, or bytes that differ from it."""
        return self.run(build.verify_shared(name, digest, device))

    def list_shared(self, *, prefix: str | None = None, owner: int | None = None,
                    uid: int | None = None) -> list[dict[str, Any]]:
        """Published names with their device, size, owner and number of holders, in name order, all of them
        page after page: those starting with ``prefix``, published by session ``owner`` (public id), by ``uid``."""
        return self.run(build.list_shared(prefix, owner, uid))

    def shared_page(self, *, limit: int | None = None, after: str | None = None, prefix: str | None = None,
                    owner: int | None = None, uid: int | None = None) -> SharedPage:
        """One page of :meth:`list_shared`: at most ``limit`` names after the name ``after`` (the last page's
        ``next``)."""
        return self.run(build.shared_page(limit, after, prefix, owner, uid))

    def open_shared(self, share: str | ShareDescriptor) -> OpenedShare:
        """Hold a share (by name or descriptor) and map it in this process; close it when done."""
        return self.run(open_share(self, OpenedShare, share))

    def close_shared(self, descriptor: ShareDescriptor) -> None:
        """Drop this session's hold (``OpenedShare.close`` calls this after unmapping)."""
        self.run(build.close_shared(descriptor))

    def revoke(self, share: Buffer | ShareDescriptor) -> None:
        """Withdraw a share this session exported (by buffer or descriptor): its names go, holders
        lose their holds and get ``Revoked`` on their next use of it."""
        if isinstance(share, ShareDescriptor):
            self.run(build.revoke(share))
        else:
            self.run(build.revoke_buffer(share))

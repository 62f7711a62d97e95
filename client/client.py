"""The synchronous client: one session with the daemon, with CUDA's names and semantics.

A new :class:`Client` is like a new CUDA host thread: no current context on any
device until :meth:`Client.set_device`, :meth:`Client.create_context`, or a
runtime-style call (``alloc``, ``synchronize``, ``mem_get_info`` ...) binds the
device's primary context. Calls are thread-safe (serialised per socket).
Each method builds its request (or plan) in :mod:`cuctxd.client.requests` and runs it
here; :class:`~cuctxd.client.async_client.AsyncClient` awaits the very same ones.
"""

from __future__ import annotations

import threading
import time
from typing import Any, TypeVar

from cuctxd.client import requests
from cuctxd.client.lanes import FRONT, Lanes, Route, lane_endpoints
from cuctxd.client.lease import Heartbeat
from cuctxd.client.objects import Buffer, Context
from cuctxd.client.pipeline import Pipeline
from cuctxd.client.requests import CHUNK_BYTES, Batch, Plan, Request, Run, SessionState, Step
from cuctxd.client.sharing import OpenedShare, open_share
from cuctxd.client.streams import Event, Stream
from cuctxd.client.transport import DEFAULT_TIMEOUT, Call, CurveKeys, KeyPath, Transport, curve_keys
from cuctxd.protos.endpoints import client_endpoint
from cuctxd.protos.errors import CuctxError
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

__all__ = ["CHUNK_BYTES", "Client"]

T = TypeVar("T")


class Client(SessionState):
    """A session with a cuctxd daemon.

    ``endpoint``: the argument, else ``$CUCTXD_ENDPOINT``, else the per-user
    default ipc:// socket. ``timeout``: seconds any call waits before raising
    :class:`~cuctxd.protos.errors.DaemonTimeout`. Use as a context manager, or call
    :meth:`close`, so the daemon frees the session's contexts and memory. A
    background thread renews the session's lease; ``heartbeat=False`` turns it
    off (the session then ends ``lease_ttl`` seconds after its last call).

    CURVE (a daemon with ``server_key``): ``server_key`` is the daemon's public
    key file (``server.key``), ``client_key`` this client's secret key file
    (``NAME.key_secret`` from ``cuctxd keygen``), whose public half must be in
    the daemon's ``allow_dir``. A daemon refusing the keys never answers, so a
    key problem shows as :class:`~cuctxd.protos.errors.DaemonTimeout` saying so. A bad
    key file raises ValueError at once.

    Device ops go straight to each device's own endpoint when the daemon offers
    them (:mod:`cuctxd.client.lanes`); ``device_endpoints=False`` sends everything
    through the main endpoint.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 name: str | None = None, heartbeat: bool = True, server_key: KeyPath | CurveKeys | None = None,
                 client_key: KeyPath | None = None, device_endpoints: bool = True) -> None:
        self.endpoint = client_endpoint(endpoint)
        self.curve = curve_keys(server_key, client_key)
        self._transport = Transport(self.endpoint, timeout, self.curve)
        self._lanes = Lanes([])
        self._lane_transports: dict[int, Transport] = {}
        self._route_lock = threading.RLock()
        try:
            hello = self._run(requests.hello(name))
        except BaseException:
            self._transport.close()
            raise
        token = self._adopt(hello)
        if device_endpoints:
            self._lanes = Lanes(lane_endpoints(self.endpoint, hello.get("endpoints", ()),
                                               hello.get("device_endpoints", ())))
        self._heartbeat = Heartbeat(self.endpoint, token, self.lease_ttl, self.curve) if heartbeat else None

    # --- plumbing -------------------------------------------------------------------

    def _run(self, operation: Request[T] | Plan[T]) -> T:
        """Run one request, or every step of a plan, on this thread."""
        if isinstance(operation, Request):  # the common case, without a plan's generator
            return self._send(operation).result(operation.timeout)
        run = Run(operation)
        while run.step is not None:
            run.resume(self._execute(run.step))
        return run.value

    def _execute(self, step: Step) -> Any:
        if isinstance(step, Batch):
            with self.pipeline() as batch:
                calls = [batch.send(request) for request in step.requests]
            return [call.result() for call in calls]
        return self._send(step).result(step.timeout)

    def _send(self, request: Request[T]) -> Call[T]:
        """Send on the request's lane (:mod:`cuctxd.client.lanes`), once what it must follow has been answered."""
        with self._route_lock:
            route = self._lanes.route(request.op, request.args)
            transport = self._transport if route.lane == FRONT else self._lane_transport(route.lane)
            if self._lane_transports:
                self._wait_for_conflicts(route)
            return transport.send(request.op, request.args, self._token, request.payload, into=request.into,
                                  convert=request.convert, reach=route.reach)

    def _lane_transport(self, device: int) -> Transport:
        transport = self._lane_transports.get(device)
        if transport is None:
            transport = Transport(self._lanes.endpoints[device], self._transport.timeout, self.curve)
            self._lane_transports[device] = transport
        return transport

    def _wait_for_conflicts(self, route: Route) -> None:
        for lane, transport in ((FRONT, self._transport), *self._lane_transports.items()):
            if lane == route.lane or not transport.busy:
                continue
            calls = transport.in_flight()
            if Lanes.conflicts(route, lane, (call.reach for call in calls)):
                for call in calls:
                    transport.wait(call)

    def pipeline(self) -> Pipeline:
        """Send memory ops without waiting for each reply (see :mod:`cuctxd.client.pipeline`)."""
        return Pipeline(self)

    def close(self) -> None:
        """End the session (the daemon frees its contexts and memory) and the connection."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        try:
            if self._token is not None:  # a daemon that is gone must not hold the caller for long
                self._run(requests.goodbye(timeout=min(self._transport.timeout, 2.0)))
        except CuctxError:
            pass  # the daemon is gone or already forgot us: nothing left to free
        finally:
            self._token = None
            self._transport.close()
            for transport in self._lane_transports.values():
                transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- daemon and devices -----------------------------------------------------------

    def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self._run(requests.ping())
        return time.perf_counter() - start

    def device_count(self) -> int:
        """``cudaGetDeviceCount``: creates no context."""
        return self._run(requests.device_count())

    def devices(self) -> list[DeviceInfo]:
        return self._run(requests.devices())

    def status(self) -> dict[str, Any]:
        return self._run(requests.status())

    def get_device(self) -> int:
        """``cudaGetDevice``: the session's current device."""
        return self._run(requests.get_device())

    def set_device(self, device: int) -> Context:
        """``cudaSetDevice``: binds the device's primary context as current; returns it."""
        return self._run(requests.set_device(self, Context, device))

    # --- contexts -------------------------------------------------------------------

    def current_context(self, device: int | None = None) -> Context | None:
        """``cuCtxGetCurrent``; None while the session's stack on ``device`` is empty."""
        return self._run(requests.current_context(self, Context, device))

    def context_stack(self, device: int | None = None) -> list[Context]:
        """The session's context stack on ``device``, bottom first."""
        return self._run(requests.context_stack(self, Context, device))

    def create_context(self, device: int | None = None, flags: int = 0) -> Context:
        """``cuCtxCreate``: a new context, pushed and current on ``device``."""
        return self._run(requests.create_context(self, Context, device, flags))

    def push_context(self, context: Context) -> None:
        self._run(requests.push_context(context))

    def pop_context(self, device: int | None = None) -> Context:
        """``cuCtxPopCurrent``: returns the popped context."""
        return self._run(requests.pop_context(self, Context, device))

    def destroy_context(self, context: Context) -> None:
        self._run(requests.destroy_context(context))

    def context_info(self, context: Context) -> Context:
        return self._run(requests.context_info(self, Context, context))

    def synchronize(self, device: int | None = None) -> None:
        """``cuCtxSynchronize`` on the current context (binds the primary if there is none)."""
        self._run(requests.synchronize(device))

    def device_synchronize(self, device: int | None = None) -> None:
        """Wait for every context alive on ``device``, this session's and others'."""
        self._run(requests.device_synchronize(device))

    # --- memory ---------------------------------------------------------------------

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        """``cuMemGetInfo``: (free, total) bytes."""
        return self._run(requests.mem_get_info(device))

    def memory_info(self, device: int | None = None) -> dict[str, Any]:
        """The whole ``mem_get_info`` answer: ``free`` and ``total`` as this session sees them,
        plus ``device_free``, ``quota``, ``reserve`` and ``limited_by`` ("quota" or "device")."""
        return self._run(requests.memory_info(device))

    def alloc(self, size: int, device: int | None = None, *, shareable: bool = False) -> Buffer:
        """Device memory in the current context of ``device`` (default: the current device).

        By default it comes from the context's stream-ordered pool (fast); pass
        ``shareable=True`` for ``cuMemAlloc`` memory, which other processes can open.
        """
        return self._run(requests.alloc(self, Buffer, size, device, shareable))

    def free(self, buffer: Buffer) -> None:
        self._run(requests.free(buffer))

    def fill(self, buffer: Buffer, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: Stream | None = None) -> None:
        self._run(requests.fill(buffer, value, offset, size, stream))

    def write(self, buffer: Buffer, data: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Host to device. Large writes go as pipelined chunks, so the transfer of one chunk
        overlaps the device copy of the one before."""
        return self._run(requests.write(buffer, data, offset, stream, self.limits["max_payload_bytes"]))

    def read(self, buffer: Buffer, size: int | None = None, offset: int = 0, *,
             stream: Stream | None = None) -> bytes:
        return self._run(requests.read(buffer, size, offset, stream))

    def read_into(self, buffer: Buffer, out: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Device to host straight into ``out`` (``recv_into``), in pipelined chunks when large."""
        return self._run(requests.read_into(buffer, out, offset, stream))

    def copy(self, src: Buffer, dst: Buffer, size: int | None = None, src_offset: int = 0,
             dst_offset: int = 0, *, stream: Stream | None = None) -> int:
        return self._run(requests.copy(src, dst, size, src_offset, dst_offset, stream))

    # --- streams and events -----------------------------------------------------------------

    def create_stream(self, device: int | None = None, *, non_blocking: bool = False) -> Stream:
        """``cuStreamCreate`` in the current context of ``device`` (binds the primary lazily)."""
        return self._run(requests.create_stream(self, Stream, device, non_blocking))

    def create_event(self, device: int | None = None, *, timing: bool = True) -> Event:
        return self._run(requests.create_event(self, Event, device, timing))

    # --- sharing between processes --------------------------------------------------------

    def export(self, buffer: Buffer) -> ShareDescriptor:
        """Make ``buffer`` shareable; the descriptor is plain data another process can open."""
        return self._run(requests.export(buffer))

    def publish(self, buffer: Buffer, name: str) -> ShareDescriptor:
        """Export ``buffer`` and publish it under ``name`` for every session to look up."""
        return self._run(requests.publish(buffer, name))

    def unpublish(self, name: str) -> None:
        self._run(requests.unpublish(name))

    def lookup(self, name: str) -> ShareDescriptor:
        return self._run(requests.lookup(name))

    def list_shared(self) -> list[dict[str, Any]]:
        """Published names with their device, size, owner and number of holders."""
        return self._run(requests.list_shared())

    def open_shared(self, share: str | ShareDescriptor) -> OpenedShare:
        """Hold a share (by name or descriptor) and map it in this process; close it when done."""
        return self._run(open_share(self, OpenedShare, share))

    def close_shared(self, descriptor: ShareDescriptor) -> None:
        """Drop this session's hold (``OpenedShare.close`` calls this after unmapping)."""
        self._run(requests.close_shared(descriptor))

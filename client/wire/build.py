"""Every op as data: the request to send and how to read its reply, for both clients.

This module is where the client knows the wire. A builder returns a
:class:`Request` (op name, wire args, payload frames, result conversion), or a
:data:`Plan` when one call takes several requests (chunked transfers, a default
device to look up): a generator that yields each :class:`Request` or
:class:`Batch` and receives its result. Nothing here does I/O. :class:`~client.
client.Client` runs requests through :class:`~cuctxd.client.wire.socket_transport.Transport` and
:class:`~cuctxd.client.api.async_client.AsyncClient` awaits them through
:class:`~cuctxd.client.wire.async_socket_transport.AsyncTransport`; both step plans with
:class:`Run`, so each op's logic exists once.

Builders that return client objects take the owning client and the class to
build (``Context`` or ``AsyncContext``, ...), so one builder serves both flavours.
What the two flavours share beyond requests (the session, the routes) is in
:mod:`cuctxd.client.wire.session`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from cuctxd.protos.errors import TimedOut, TooLarge
from cuctxd.protos.limits import MAX_VERSION_WAIT_MS
from cuctxd.protos.records import DeviceInfo, ShareDescriptor
from cuctxd.protos.version import PROTOCOL_VERSION

#: Writes and reads larger than two of these travel as pipelined chunks of this size.
CHUNK_BYTES = 4 << 20

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Turns a reply's ``(result map, payload frames)`` into what the caller gets.
Convert = Callable[[dict[str, Any], list[Any]], T]


@dataclass(frozen=True)
class Request(Generic[T]):
    """One request: ``args`` holds only the arguments that travel (no ``None`` values).

    ``into``: a writable buffer that receives the reply's first payload frame
    directly; ``timeout``: seconds to wait instead of the client's default.
    """

    op: str
    args: dict[str, Any]
    convert: Convert[T]
    payload: tuple[Any, ...] = ()
    into: Any = None
    timeout: float | None = None


@dataclass(frozen=True)
class Batch:
    """Requests sent without waiting for each reply; the step's result is the list of their
    results in order, and the first error is raised once every reply is in."""

    requests: tuple[Request[Any], ...]


@dataclass(frozen=True)
class Send:
    """Send ``request`` without waiting: the step's result is a handle to give :class:`Wait` later.

    ``early``: before the bytes it copies from are in place (PROTOCOL.md, "Early requests"), so that its
    trip overlaps the copy; only an shm lane takes it so, else the result is None (send it again once
    they are). Once they are, even if the copy failed, call ``sent.transport.source_ready(sent)``.
    ``many``: one of many requests out at once (a load's DMAs): the socket carries it, which has room for
    them all, where an shm lane holds one request at a time."""

    request: Request[Any]
    early: bool = False
    many: bool = False


@dataclass(frozen=True)
class Wait:
    """The result of a request sent with :class:`Send` (its error raised here)."""

    sent: Any


@dataclass(frozen=True)
class Local:
    """Work in this process between requests (mapping an fd, copying through a host buffer): the sync
    client calls ``run()`` on its thread, the async one in a worker thread; the step's result is its return."""

    run: Callable[[], Any]


Step = Request[Any] | Batch | Send | Wait | Local

#: A call that takes several requests: yields each step, receives its result, returns the answer.
Plan = Generator[Step, Any, T]


def _single(request: Request[T]) -> Plan[T]:
    result: T = yield request
    return result


def unanswered(request: Request[Any]) -> Plan[None]:
    """Send ``request`` on the socket without waiting for its answer, which a later wait on that socket reads
    and drops (a failure goes unreported); the session's later requests to the device run after it."""
    yield Send(request, many=True)


class Run(Generic[T]):
    """Steps one op: run :attr:`step` (None once done), hand its result to :meth:`resume` (or its
    error to :meth:`throw`: the plan may catch it, else it ends the op), repeat; then :attr:`value`
    is the answer."""

    def __init__(self, operation: Request[T] | Plan[T]) -> None:
        self._plan = _single(operation) if isinstance(operation, Request) else operation
        self.step: Step | None = None
        self.value: T
        self.resume(None)

    def resume(self, result: Any) -> None:
        try:
            self.step = self._plan.send(result)
        except StopIteration as done:
            self.step = None
            self.value = done.value

    def throw(self, error: BaseException) -> None:
        """The step raised ``error``: raise it in the plan, which may handle it and go on."""
        try:
            self.step = self._plan.throw(error)
        except StopIteration as done:
            self.step = None
            self.value = done.value


class OnDevice(Protocol):
    """A session-scoped handle on one device: a buffer, context, stream or event of either client."""

    @property
    def handle(self) -> int: ...

    @property
    def device(self) -> int: ...


class Sized(OnDevice, Protocol):
    @property
    def size(self) -> int: ...


class FromWire(Protocol[T_co]):
    """A client object class built from a wire record (``Context``, ``AsyncBuffer``, ...)."""

    def from_wire(self, client: Any, wire: dict[str, Any], /) -> T_co: ...


class Freeable(OnDevice, Protocol):
    """A buffer of either client: ``freed`` once a ``free`` of it has been answered."""

    freed: bool


# --- building blocks -----------------------------------------------------------------------


def _request(op: str, convert: Convert[T], payload: tuple[Any, ...] = (), into: Any = None,
             timeout: float | None = None, **args: Any) -> Request[T]:
    return Request(op, {k: v for k, v in args.items() if v is not None}, convert, payload, into, timeout)


def _nothing(result: dict[str, Any], frames: list[Any]) -> None:
    return None


def _result(result: dict[str, Any], frames: list[Any]) -> dict[str, Any]:
    return result


def _size(result: dict[str, Any], frames: list[Any]) -> int:
    return int(result["size"])


def _bytes(result: dict[str, Any], frames: list[Any]) -> bytes:
    """The reply's payload frame (a ``zmq.Frame``, or bytes from an shm lane) as bytes."""
    return bytes(frames[0]) if frames else b""


def _field(name: str, kind: Callable[[Any], T]) -> Convert[T]:
    return lambda result, frames: kind(result[name])


def _built(owner: Any, kind: FromWire[T], name: str) -> Convert[T]:
    return lambda result, frames: kind.from_wire(owner, result[name])


def _whole(owner: Any, kind: FromWire[T]) -> Convert[T]:
    return lambda result, frames: kind.from_wire(owner, result)


def _handle(stream: OnDevice | None) -> int | None:
    return None if stream is None else stream.handle


def _on(thing: OnDevice, **args: Any) -> dict[str, Any]:
    return {"device": thing.device, **args}


# --- session and daemon --------------------------------------------------------------------


def hello(name: str | None, timeout: float) -> Request[dict[str, Any]]:
    return _request("hello", _result, timeout=timeout, protocol=PROTOCOL_VERSION,
                    client=name or os.path.basename(sys.argv[0] or "python"), pid=os.getpid())


def goodbye(timeout: float) -> Request[None]:
    return _request("goodbye", _nothing, timeout=timeout)


# Ops without arguments are the same request every time: built once.
_PING: Request[None] = Request("ping", {}, _nothing)
_DEVICE_COUNT: Request[int] = Request("device_count", {}, _field("count", int))
_DEVICES: Request[list[DeviceInfo]] = Request(
    "devices", {}, lambda result, _: [DeviceInfo.from_wire(d) for d in result["devices"]])
_STATUS: Request[dict[str, Any]] = Request("status", {}, _result)
_GET_DEVICE: Request[int] = Request("get_device", {}, _field("device", int))


def ping() -> Request[None]:
    return _PING


def device_count() -> Request[int]:
    return _DEVICE_COUNT


def devices() -> Request[list[DeviceInfo]]:
    return _DEVICES


def status() -> Request[dict[str, Any]]:
    return _STATUS


def close_session(session_id: int) -> Request[None]:
    return _request("close_session", _nothing, session_id=session_id)


def shutdown() -> Request[None]:
    return _request("shutdown", _nothing)


def get_device() -> Request[int]:
    return _GET_DEVICE


def set_device(owner: Any, context: FromWire[T], device: int) -> Request[T]:
    return _request("set_device", _built(owner, context, "context"), device=device)


# --- contexts ------------------------------------------------------------------------------


def current_context(owner: Any, context: FromWire[T], device: int | None) -> Request[T | None]:
    def convert(result: dict[str, Any], frames: list[Any]) -> T | None:
        return None if result["context"] is None else context.from_wire(owner, result["context"])

    return _request("current_context", convert, device=device)


def context_stack(owner: Any, context: FromWire[T], device: int | None) -> Request[list[T]]:
    return _request("context_stack", lambda result, _: [context.from_wire(owner, w) for w in result["stack"]],
                    device=device)


def create_context(owner: Any, context: FromWire[T], device: int | None, flags: int) -> Request[T]:
    return _request("create_context", _built(owner, context, "context"), device=device, flags=flags)


def push_context(context: OnDevice) -> Request[None]:
    return _request("push_context", _nothing, **_on(context, context=context.handle))


def pop_context(owner: Any, context: FromWire[T], device: int | None) -> Request[T]:
    return _request("pop_context", _built(owner, context, "context"), device=device)


def destroy_context(context: OnDevice) -> Request[None]:
    return _request("destroy_context", _nothing, **_on(context, context=context.handle))


def context_info(owner: Any, kind: FromWire[T], context: OnDevice) -> Request[T]:
    return _request("context_info", _built(owner, kind, "context"), **_on(context, context=context.handle))


def synchronize(device: int | None) -> Request[None]:
    return _request("synchronize", _nothing, device=device)


def device_synchronize(device: int | None) -> Request[None]:
    return _request("device_synchronize", _nothing, device=device)


# --- memory --------------------------------------------------------------------------------


def mem_get_info(device: int | None) -> Request[tuple[int, int]]:
    return _request("mem_get_info", lambda result, _: (int(result["free"]), int(result["total"])), device=device)


def memory_info(device: int | None) -> Request[dict[str, Any]]:
    return _request("mem_get_info", _result, device=device)


def alloc(owner: Any, buffer: FromWire[T], size: int, device: int | None, shareable: bool) -> Request[T]:
    return _request("alloc", _built(owner, buffer, "buffer"), size=size, device=device, shareable=shareable)


def alloc_version(owner: Any, buffer: FromWire[T], size: int, device: int | None, name: str
                  ) -> Request[tuple[T, str, tuple[str, ...]]]:
    """A shareable buffer for ``name``'s next version (the name's spare where it fits): the buffer, the id of its
    allocation and the name's buffers now (PROTOCOL.md, "Versions")."""
    def convert(result: dict[str, Any], frames: list[Any]) -> tuple[T, str, tuple[str, ...]]:
        return buffer.from_wire(owner, result["buffer"]), str(result["buffer_id"]), tuple(result["buffers"])

    return _request("alloc", convert, size=size, device=device, shareable=True, version_of=name)


def _already_done() -> Plan[None]:
    yield from ()


def free(buffer: Freeable) -> Request[None] | Plan[None]:
    """Free once, whichever route (``buffer.free()`` or ``client.free(buffer)``): a buffer already
    freed sends nothing, and ``freed`` turns True when the daemon has answered. A handle the
    daemon does not know (say, freed with its context) raises ``UnknownHandle``."""
    if buffer.freed:
        return _already_done()

    def freed(result: dict[str, Any], frames: list[Any]) -> None:
        buffer.freed = True

    return _request("free", freed, **_on(buffer, buffer=buffer.handle))


def fill(buffer: OnDevice, value: int, offset: int, size: int | None, stream: OnDevice | None) -> Request[int]:
    return _request("fill", _size, **_on(buffer, buffer=buffer.handle, value=value, offset=offset, size=size,
                                         stream=_handle(stream)))


def copy(src: OnDevice, dst: OnDevice, size: int | None, src_offset: int, dst_offset: int,
         stream: OnDevice | None) -> Request[int]:
    return _request("copy", _size, **_on(src, dst_device=dst.device, src=src.handle, dst=dst.handle, size=size,
                                         src_offset=src_offset, dst_offset=dst_offset, stream=_handle(stream)))


def write_frame(buffer: OnDevice, data: Any, offset: int, stream: OnDevice | None) -> Request[int]:
    """One ``write`` request carrying all of ``data`` (see :func:`write` for large data)."""
    return _request("write", _size, (data,), **_on(buffer, buffer=buffer.handle, offset=offset,
                                                    stream=_handle(stream)))


def read_frame(buffer: OnDevice, size: int | None, offset: int, stream: OnDevice | None) -> Request[bytes]:
    """One ``read`` request, its bytes in one reply frame (see :func:`read` for large reads)."""
    return _request("read", _bytes, **_on(buffer, buffer=buffer.handle, offset=offset, size=size,
                                          stream=_handle(stream)))


def write(buffer: OnDevice, data: Any, offset: int, stream: OnDevice | None, max_payload: int) -> Plan[int]:
    """Host to device. Large writes go as pipelined chunks, so the transfer of one chunk
    overlaps the device copy of the one before. :class:`TooLarge` before anything is sent
    when a frame would exceed the daemon's ``max_payload_bytes``."""
    view = memoryview(data).cast("B")
    whole = view.nbytes <= 2 * CHUNK_BYTES
    frame = view.nbytes if whole else CHUNK_BYTES
    if frame > max_payload:
        raise TooLarge(f"a {frame}-byte payload frame exceeds the daemon's limit of {max_payload} bytes", "write")
    if whole:
        written: int = yield write_frame(buffer, view, offset, stream)
        return written
    sizes = yield Batch(tuple(write_frame(buffer, view[at:at + CHUNK_BYTES], offset + at, stream)
                              for at in range(0, view.nbytes, CHUNK_BYTES)))
    return sum(sizes)


def read(buffer: Sized, size: int | None, offset: int, stream: OnDevice | None) -> Plan[bytes]:
    """Device to host; large reads land in one host buffer as pipelined chunks."""
    size = buffer.size - offset if size is None else size
    if 2 * CHUNK_BYTES < size <= buffer.size - offset:  # out-of-range sizes: the daemon says why
        out = bytearray(size)
        yield from _read_chunks(buffer, memoryview(out), offset, stream)
        return bytes(out)
    data: bytes = yield read_frame(buffer, size, offset, stream)
    return data


def read_into(buffer: OnDevice, out: Any, offset: int, stream: OnDevice | None) -> Request[int] | Plan[int]:
    """Device to host straight into ``out`` (``recv_into``): one request, or pipelined chunks when large."""
    view = memoryview(out).cast("B")
    if view.nbytes <= 2 * CHUNK_BYTES:
        return _read_chunk(buffer, view, offset, stream)
    return _read_chunks(buffer, view, offset, stream)


def _read_chunk(buffer: OnDevice, view: memoryview, offset: int, stream: OnDevice | None) -> Request[int]:
    return _request("read", _size, into=view, **_on(buffer, buffer=buffer.handle, offset=offset,
                                                    size=view.nbytes, stream=_handle(stream)))


def _read_chunks(buffer: OnDevice, view: memoryview, offset: int, stream: OnDevice | None) -> Plan[int]:
    sizes = yield Batch(tuple(_read_chunk(buffer, view[at:at + CHUNK_BYTES], offset + at, stream)
                              for at in range(0, view.nbytes, CHUNK_BYTES)))
    return sum(sizes)


# --- streams and events --------------------------------------------------------------------


def create_stream(owner: Any, stream: FromWire[T], device: int | None, non_blocking: bool) -> Request[T]:
    return _request("create_stream", _whole(owner, stream), device=device, non_blocking=non_blocking)


def create_event(owner: Any, event: FromWire[T], device: int | None, timing: bool) -> Request[T]:
    return _request("create_event", _whole(owner, event), device=device, timing=timing)


def stream_query(stream: OnDevice) -> Request[bool]:
    return _request("stream_query", _field("done", bool), **_on(stream, stream=stream.handle))


def stream_synchronize(stream: OnDevice) -> Request[None]:
    return _request("stream_synchronize", _nothing, **_on(stream, stream=stream.handle))


def stream_wait_event(stream: OnDevice, event: OnDevice) -> Request[None]:
    return _request("stream_wait_event", _nothing, **_on(stream, stream=stream.handle, event=event.handle))


def destroy_stream(stream: OnDevice) -> Request[None]:
    return _request("destroy_stream", _nothing, **_on(stream, stream=stream.handle))


def record_event(event: OnDevice, stream: OnDevice | None) -> Request[None]:
    return _request("record_event", _nothing, **_on(event, event=event.handle, stream=_handle(stream)))


def event_query(event: OnDevice) -> Request[bool]:
    return _request("event_query", _field("done", bool), **_on(event, event=event.handle))


def event_synchronize(event: OnDevice) -> Request[None]:
    return _request("event_synchronize", _nothing, **_on(event, event=event.handle))


def event_elapsed_time(start: OnDevice, end: OnDevice) -> Request[float]:
    return _request("event_elapsed_time", _field("ms", float), **_on(start, start=start.handle, end=end.handle))


def destroy_event(event: OnDevice) -> Request[None]:
    return _request("destroy_event", _nothing, **_on(event, event=event.handle))


# --- sharing between processes (opening and closing a mapping: cuctxd.client.api.sharing) --------------


def _share(result: dict[str, Any], frames: list[Any]) -> ShareDescriptor:
    return ShareDescriptor.from_wire(result["share"])


def export(buffer: OnDevice) -> Request[ShareDescriptor]:
    return _request("export", _share, **_on(buffer, buffer=buffer.handle))


def publish(buffer: OnDevice, name: str, manifest: bytes | None = None, persistent: bool = False,
            read_only: bool = False, once: bool = False, replace: bool = False, copy: bool = False,
            stage: bool = False, version: bool = False) -> Request[ShareDescriptor]:
    """``version``: the name's next version; the daemon takes the buffer over, so it counts as freed here."""
    def convert(result: dict[str, Any], frames: list[Any]) -> ShareDescriptor:
        if version and hasattr(buffer, "freed"):
            buffer.freed = True
        return _share(result, frames)

    return _request("publish", convert, **_on(buffer, buffer=buffer.handle, name=name, manifest=manifest,
                                              persistent=persistent or None, read_only=read_only or None,
                                              once=once or None, replace=replace or None, copy=copy or None,
                                              stage=stage or None, version=version or None))


def unpublish(name: str, device: int | None = None) -> Request[None]:
    return _request("unpublish", _nothing, name=name, device=device)


def lookup(name: str, device: int | None = None, version: int | None = None) -> Request[ShareDescriptor]:
    return _request("lookup", _share, name=name, device=device, version=version)


#: Seconds a ``wait_version`` reply may take beyond the wait the daemon was asked for.
WAIT_SLACK_S = 30.0


def wait_version(name: str, after: int, timeout: float | None) -> Plan[int]:
    """The number of ``name``'s current version once it is newer than ``after``; :class:`TimedOut` after
    ``timeout`` seconds. The daemon waits (one request); without a timeout, one request per
    ``MAX_VERSION_WAIT_MS`` that passed without one."""
    while True:
        wait_ms = MAX_VERSION_WAIT_MS if timeout is None else min(MAX_VERSION_WAIT_MS, max(0, int(timeout * 1000)))
        try:
            found: int = yield _request("wait_version", _field("version", int), timeout=wait_ms / 1000 + WAIT_SLACK_S,
                                        name=name, after=after, timeout_ms=wait_ms)
            return found
        except TimedOut:
            if timeout is not None:
                raise


def verify_shared(name: str, digest: str, device: int) -> Request[dict[str, Any]]:
    """Have the daemon vouch for ``name``'s layout digest (on ``device``, where its lookup says it is) before
    relying on it. Result: ``digest``, ``verified`` (``"publisher"`` or ``"daemon"``), ``hashed``."""
    return _request("verify_shared", _result, name=name, digest=digest, device=device)


def lookup_verified(name: str, digest: str, device: int | None = None) -> Plan[ShareDescriptor]:
    """The descriptor published as ``name`` (its copy on ``device``), once the daemon vouched that its layout has
    ``digest`` (:func:`verify_shared`; ``CUCTXD_ERROR_DIGEST_MISMATCH`` otherwise)."""
    descriptor: ShareDescriptor = yield lookup(name, device)
    yield verify_shared(name, digest, descriptor.device)
    return descriptor


@dataclass(frozen=True)
class SharedPage:
    """One page of ``list_shared``: its ``shared`` records in name order; ``next``, the name to pass as
    ``after`` for the next page (None on the last); ``count``, the names published daemon-wide."""

    shared: list[dict[str, Any]]
    next: str | None
    count: int


def _shared_page(result: dict[str, Any], frames: list[Any]) -> SharedPage:
    return SharedPage(list(result["shared"]), result.get("next"), int(result["count"]))


def shared_page(limit: int | None = None, after: str | None = None, prefix: str | None = None,
                owner: int | None = None, uid: int | None = None) -> Request[SharedPage]:
    """One page of the names (PROTOCOL.md, ``list_shared``): at most ``limit`` (the daemon's most by default),
    after the name ``after``, starting with ``prefix``, published by session ``owner`` (public id) and ``uid``."""
    return _request("list_shared", _shared_page, limit=limit, after=after, prefix=prefix or None, owner=owner,
                    uid=uid)


def list_shared(prefix: str | None = None, owner: int | None = None, uid: int | None = None
                ) -> Plan[list[dict[str, Any]]]:
    """Every name the filters select, page after page (each page one request the daemon answers in time
    bounded by the page); a name published or removed meanwhile may be listed or not."""
    shared: list[dict[str, Any]] = []
    after = None
    while True:
        page: SharedPage = yield shared_page(after=after, prefix=prefix, owner=owner, uid=uid)
        shared.extend(page.shared)
        if page.next is None:
            return shared
        after = page.next


def open_shared(descriptor: ShareDescriptor, pool_fd: bool = False) -> Request[tuple[ShareDescriptor, str | None]]:
    """Hold the share; the answer is the daemon's fresh descriptor with what the name said (its name,
    publisher, manifest, read-only flag: ``open_shared`` knows the share, not the name), and with
    ``pool_fd`` the fd channel ticket of its pool."""
    def convert(result: dict[str, Any], frames: list[Any]) -> tuple[ShareDescriptor, str | None]:
        named = {"name": descriptor.name, "publisher": descriptor.publisher, "manifest": descriptor.manifest,
                 "read_only": descriptor.read_only, "version": descriptor.version}
        return ShareDescriptor.from_wire({**result["share"], **named}), result.get("ticket")

    return _request("open_shared", convert, device=descriptor.device, share_id=descriptor.share_id,
                    pool_fd=pool_fd or None)


def close_shared(descriptor: ShareDescriptor) -> Request[None]:
    return _request("close_shared", _nothing, device=descriptor.device, share_id=descriptor.share_id)


def revoke(descriptor: ShareDescriptor) -> Request[None]:
    """Withdraw a share this session exported: holders' next use of it raises :class:`Revoked`."""
    return _request("revoke", _nothing, device=descriptor.device, share_id=descriptor.share_id)


def revoke_buffer(buffer: OnDevice) -> Plan[None]:
    """Revoke the share of ``buffer`` (its descriptor is what ``export`` answers for it)."""
    descriptor = yield export(buffer)
    yield revoke(descriptor)


# --- the data plane: shared host buffers (their mapping: cuctxd.client.data_plane.host_buffers) --------------


def host_alloc(device: int | None, size: int, reuse: bool = False) -> Request[dict[str, Any]]:
    """Result: ``host`` (handle), ``size``, ``device`` and ``ticket``."""
    return _request("host_alloc", _result, device=device, size=size, reuse=reuse or None)


def shm_lane(device: int) -> Request[dict[str, Any]]:
    """Result: ``ticket`` (three fds on the fd channel) and ``size``."""
    return _request("shm_lane", _result, device=device)


def host_free(host: OnDevice) -> Request[None]:
    return _request("host_free", _nothing, **_on(host, host=host.handle))


def memcpy_htod(buffer: OnDevice, host: OnDevice, offset: int, host_offset: int, size: int | None,
                stream: OnDevice | None) -> Request[int]:
    return _request("memcpy_htod", _size, **_on(buffer, buffer=buffer.handle, host=host.handle, offset=offset,
                                                host_offset=host_offset, size=size, stream=_handle(stream)))


def memcpy_dtoh(buffer: OnDevice, host: OnDevice, offset: int, host_offset: int, size: int | None,
                stream: OnDevice | None) -> Request[int]:
    return _request("memcpy_dtoh", _size, **_on(buffer, buffer=buffer.handle, host=host.handle, offset=offset,
                                                host_offset=host_offset, size=size, stream=_handle(stream)))


def stream_ordered(device: int, stream: int | None, entries: bytes) -> Request[dict[str, Any]]:
    """A batch of packed stream-ordered entries (:mod:`cuctxd.client.wire.stream_ordered`)."""
    return _request("stream_ordered", _result, device=device, stream=stream, ops=entries)

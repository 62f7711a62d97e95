"""Every op as data: the request to send and how to read its reply, for both clients.

This module is where the client knows the wire. A builder returns a
:class:`Request` (an instance of the op's class from :mod:`cuctxd.protos.ops` and its siblings, payload
frames, result conversion: the op's wire name and arguments come from that instance, so an op's name and
fields are declared once, where the daemon decodes them), or a
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
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from cuctxd.protos import ops, pinned_ops, sharing_ops, stream_ops, system_ops
from cuctxd.protos.errors import TimedOut, TooLarge
from cuctxd.protos.layouts import stated_digest
from cuctxd.protos.limits import MAX_LISTED, MAX_VERSION_WAIT_MS
from cuctxd.protos.records import DeviceInfo, ShareDescriptor
from cuctxd.protos.schema import OpArgs, encode_args, spec_of
from cuctxd.protos.version import PROTOCOL_VERSION

#: Writes and reads larger than two of these travel as pipelined chunks of this size.
CHUNK_BYTES = 4 << 20

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Turns a reply's ``(result map, payload frames)`` into what the caller gets.
Convert = Callable[[dict[str, Any], list[Any]], T]


@dataclass(slots=True)
class Request(Generic[T]):
    """One request: ``op_args``, an instance of the op's class (``ops.Alloc(size=...)``), and what to do
    with its reply. ``op`` (the wire name) and ``args`` (the wire arguments: the fields not at their
    default, :func:`~cuctxd.protos.schema.encode_args`) are derived from it here, once; anything else
    (an op name, a map of arguments) is a TypeError. Not changed once made (the argument-less ones are
    shared); not frozen only because a frozen dataclass takes twice as long to make, once per request.

    ``into``: a writable buffer that receives the reply's first payload frame
    directly; ``timeout``: seconds to wait instead of the client's default.
    """

    op_args: OpArgs
    convert: Convert[T]
    payload: tuple[Any, ...] = ()
    into: Any = None
    timeout: float | None = None
    op: str = field(init=False, repr=False, compare=False)
    args: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.op = spec_of(self.op_args).name
        self.args = encode_args(self.op_args)


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


# --- session and daemon --------------------------------------------------------------------


def hello(name: str | None, timeout: float) -> Request[dict[str, Any]]:
    return Request(ops.Hello(protocol=PROTOCOL_VERSION, client=name or os.path.basename(sys.argv[0] or "python"),
                             pid=os.getpid()), _result, timeout=timeout)


def goodbye(timeout: float) -> Request[None]:
    return Request(ops.Goodbye(), _nothing, timeout=timeout)


# Ops without arguments are the same request every time: built once.
_PING: Request[None] = Request(ops.Ping(), _nothing)
_DEVICE_COUNT: Request[int] = Request(ops.DeviceCount(), _field("count", int))
_DEVICES: Request[list[DeviceInfo]] = Request(
    ops.Devices(), lambda result, _: [DeviceInfo.from_wire(d) for d in result["devices"]])
_STATUS: Request[dict[str, Any]] = Request(ops.Status(), _result)
_GET_DEVICE: Request[int] = Request(ops.GetDevice(), _field("device", int))
_HEARTBEAT: Request[None] = Request(sharing_ops.Heartbeat(), _nothing)


def ping() -> Request[None]:
    return _PING


def device_count() -> Request[int]:
    return _DEVICE_COUNT


def devices() -> Request[list[DeviceInfo]]:
    return _DEVICES


def status() -> Request[dict[str, Any]]:
    return _STATUS


def heartbeat() -> Request[None]:
    return _HEARTBEAT


def close_session(session_id: int) -> Request[None]:
    return Request(system_ops.CloseSession(session_id=session_id), _nothing)


def shutdown() -> Request[None]:
    return Request(system_ops.Shutdown(), _nothing)


def get_device() -> Request[int]:
    return _GET_DEVICE


def set_device(owner: Any, context: FromWire[T], device: int) -> Request[T]:
    return Request(ops.SetDevice(device=device), _built(owner, context, "context"))


# --- contexts ------------------------------------------------------------------------------


def current_context(owner: Any, context: FromWire[T], device: int | None) -> Request[T | None]:
    def convert(result: dict[str, Any], frames: list[Any]) -> T | None:
        return None if result["context"] is None else context.from_wire(owner, result["context"])

    return Request(ops.CurrentContext(device=device), convert)


def context_stack(owner: Any, context: FromWire[T], device: int | None) -> Request[list[T]]:
    return Request(ops.ContextStack(device=device),
                   lambda result, _: [context.from_wire(owner, w) for w in result["stack"]])


def create_context(owner: Any, context: FromWire[T], device: int | None, flags: int) -> Request[T]:
    return Request(ops.CreateContext(device=device, flags=flags), _built(owner, context, "context"))


def push_context(context: OnDevice) -> Request[None]:
    return Request(ops.PushContext(context=context.handle, device=context.device), _nothing)


def pop_context(owner: Any, context: FromWire[T], device: int | None) -> Request[T]:
    return Request(ops.PopContext(device=device), _built(owner, context, "context"))


def destroy_context(context: OnDevice) -> Request[None]:
    return Request(ops.DestroyContext(context=context.handle, device=context.device), _nothing)


def context_info(owner: Any, kind: FromWire[T], context: OnDevice) -> Request[T]:
    return Request(ops.ContextInfo(context=context.handle, device=context.device), _built(owner, kind, "context"))


def synchronize(device: int | None) -> Request[None]:
    return Request(ops.Synchronize(device=device), _nothing)


def device_synchronize(device: int | None) -> Request[None]:
    return Request(ops.DeviceSynchronize(device=device), _nothing)


# --- memory --------------------------------------------------------------------------------


def mem_get_info(device: int | None) -> Request[tuple[int, int]]:
    return Request(ops.MemGetInfo(device=device), lambda result, _: (int(result["free"]), int(result["total"])))


def memory_info(device: int | None) -> Request[dict[str, Any]]:
    return Request(ops.MemGetInfo(device=device), _result)


def alloc(owner: Any, buffer: FromWire[T], size: int, device: int | None, shareable: bool) -> Request[T]:
    return Request(ops.Alloc(size=size, device=device, shareable=shareable), _built(owner, buffer, "buffer"))


def alloc_version(owner: Any, buffer: FromWire[T], size: int, device: int | None, name: str
                  ) -> Request[tuple[T, str, tuple[str, ...]]]:
    """A shareable buffer for ``name``'s next version (the name's spare where it fits): the buffer, the id of its
    allocation and the name's buffers now (PROTOCOL.md, "Versions")."""
    def convert(result: dict[str, Any], frames: list[Any]) -> tuple[T, str, tuple[str, ...]]:
        return buffer.from_wire(owner, result["buffer"]), str(result["buffer_id"]), tuple(result["buffers"])

    return Request(ops.Alloc(size=size, device=device, shareable=True, version_of=name), convert)


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

    return Request(ops.Free(buffer=buffer.handle, device=buffer.device), freed)


def fill(buffer: OnDevice, value: int, offset: int, size: int | None, stream: OnDevice | None) -> Request[int]:
    return Request(ops.Fill(buffer=buffer.handle, value=value, offset=offset, size=size, device=buffer.device,
                            stream=_handle(stream)), _size)


def copy(src: OnDevice, dst: OnDevice, size: int | None, src_offset: int, dst_offset: int,
         stream: OnDevice | None) -> Request[int]:
    return Request(ops.Copy(src=src.handle, dst=dst.handle, size=size, src_offset=src_offset, dst_offset=dst_offset,
                            device=src.device, dst_device=dst.device, stream=_handle(stream)), _size)


def write_frame(buffer: OnDevice, data: Any, offset: int, stream: OnDevice | None) -> Request[int]:
    """One ``write`` request carrying all of ``data`` (see :func:`write` for large data)."""
    return Request(ops.Write(buffer=buffer.handle, offset=offset, device=buffer.device, stream=_handle(stream)),
                   _size, (data,))


def read_frame(buffer: OnDevice, size: int | None, offset: int, stream: OnDevice | None) -> Request[bytes]:
    """One ``read`` request, its bytes in one reply frame (see :func:`read` for large reads)."""
    return Request(ops.Read(buffer=buffer.handle, offset=offset, size=size, device=buffer.device,
                            stream=_handle(stream)), _bytes)


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
    return Request(ops.Read(buffer=buffer.handle, offset=offset, size=view.nbytes, device=buffer.device,
                            stream=_handle(stream)), _size, into=view)


def _read_chunks(buffer: OnDevice, view: memoryview, offset: int, stream: OnDevice | None) -> Plan[int]:
    sizes = yield Batch(tuple(_read_chunk(buffer, view[at:at + CHUNK_BYTES], offset + at, stream)
                              for at in range(0, view.nbytes, CHUNK_BYTES)))
    return sum(sizes)


# --- streams and events --------------------------------------------------------------------


def create_stream(owner: Any, stream: FromWire[T], device: int | None, non_blocking: bool) -> Request[T]:
    return Request(stream_ops.CreateStream(device=device, non_blocking=non_blocking), _whole(owner, stream))


def create_event(owner: Any, event: FromWire[T], device: int | None, timing: bool) -> Request[T]:
    return Request(stream_ops.CreateEvent(device=device, timing=timing), _whole(owner, event))


def stream_query(stream: OnDevice) -> Request[bool]:
    return Request(stream_ops.StreamQuery(stream=stream.handle, device=stream.device), _field("done", bool))


def stream_synchronize(stream: OnDevice) -> Request[None]:
    return Request(stream_ops.StreamSynchronize(stream=stream.handle, device=stream.device), _nothing)


def stream_wait_event(stream: OnDevice, event: OnDevice) -> Request[None]:
    return Request(stream_ops.StreamWaitEvent(stream=stream.handle, event=event.handle, device=stream.device), _nothing)


def destroy_stream(stream: OnDevice) -> Request[None]:
    return Request(stream_ops.DestroyStream(stream=stream.handle, device=stream.device), _nothing)


def record_event(event: OnDevice, stream: OnDevice | None) -> Request[None]:
    return Request(stream_ops.RecordEvent(event=event.handle, stream=_handle(stream), device=event.device), _nothing)


def event_query(event: OnDevice) -> Request[bool]:
    return Request(stream_ops.EventQuery(event=event.handle, device=event.device), _field("done", bool))


def event_synchronize(event: OnDevice) -> Request[None]:
    return Request(stream_ops.EventSynchronize(event=event.handle, device=event.device), _nothing)


def event_elapsed_time(start: OnDevice, end: OnDevice) -> Request[float]:
    return Request(stream_ops.EventElapsedTime(start=start.handle, end=end.handle, device=start.device),
                   _field("ms", float))


def destroy_event(event: OnDevice) -> Request[None]:
    return Request(stream_ops.DestroyEvent(event=event.handle, device=event.device), _nothing)


# --- sharing between processes (opening and closing a mapping: cuctxd.client.api.sharing) --------------


def _share(result: dict[str, Any], frames: list[Any]) -> ShareDescriptor:
    return ShareDescriptor.from_wire(result["share"])


def export(buffer: OnDevice) -> Request[ShareDescriptor]:
    return Request(sharing_ops.Export(buffer=buffer.handle, device=buffer.device), _share)


def publish(buffer: OnDevice, name: str, manifest: bytes | None = None, persistent: bool = False,
            read_only: bool = False, once: bool = False, replace: bool = False, copy: bool = False,
            stage: bool = False, version: bool = False) -> Request[ShareDescriptor]:
    """``version``: the name's next version; the daemon takes the buffer over, so it counts as freed here."""
    def convert(result: dict[str, Any], frames: list[Any]) -> ShareDescriptor:
        if version and hasattr(buffer, "freed"):
            buffer.freed = True
        return _share(result, frames)

    return Request(sharing_ops.Publish(buffer=buffer.handle, name=name, device=buffer.device, manifest=manifest,
                                       persistent=persistent, read_only=read_only, once=once, replace=replace,
                                       copy=copy, stage=stage, version=version), convert)


def unpublish(name: str, device: int | None = None) -> Request[None]:
    return Request(sharing_ops.Unpublish(name=name, device=device), _nothing)


def lookup(name: str, device: int | None = None, version: int | None = None) -> Request[ShareDescriptor]:
    return Request(sharing_ops.Lookup(name=name, device=device, version=version), _share)


#: Seconds a ``wait_version`` reply may take beyond the wait the daemon was asked for.
WAIT_SLACK_S = 30.0


def wait_version(name: str, after: int, timeout: float | None) -> Plan[int]:
    """The number of ``name``'s current version once it is newer than ``after``; :class:`TimedOut` after
    ``timeout`` seconds. The daemon waits (one request); without a timeout, one request per
    ``MAX_VERSION_WAIT_MS`` that passed without one."""
    while True:
        wait_ms = MAX_VERSION_WAIT_MS if timeout is None else min(MAX_VERSION_WAIT_MS, max(0, int(timeout * 1000)))
        try:
            found: int = yield Request(sharing_ops.WaitVersion(name=name, after=after, timeout_ms=wait_ms),
                                       _field("version", int), timeout=wait_ms / 1000 + WAIT_SLACK_S)
            return found
        except TimedOut:
            if timeout is not None:
                raise


def verify_shared(name: str, digest: str, device: int) -> Request[dict[str, Any]]:
    """Have the daemon vouch for ``name``'s layout digest (on ``device``, where its lookup says it is) before
    relying on it. Result: ``digest``, ``verified`` (``"publisher"`` or ``"daemon"``), ``hashed``."""
    return Request(sharing_ops.VerifyShared(name=name, digest=digest, device=device), _result)


def lookup_verified(name: str, digest: str, device: int | None = None) -> Plan[ShareDescriptor]:
    """The descriptor published as ``name`` (its copy on ``device``), once the daemon vouched that its layout has
    ``digest`` (:func:`verify_shared`; ``CUCTXD_ERROR_DIGEST_MISMATCH`` otherwise); a version the daemon was
    finding the digest of, looked up again once found."""
    descriptor: ShareDescriptor = yield lookup(name, device)
    yield verify_shared(name, digest, descriptor.device)
    if descriptor.version and stated_digest(descriptor.manifest or b"") is None:  # its digest came meanwhile
        descriptor = yield lookup(name, descriptor.device, descriptor.version)
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
    return Request(sharing_ops.ListShared(limit=MAX_LISTED if limit is None else limit, after=after,
                                          prefix=prefix or "", owner=owner, uid=uid), _shared_page)


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

    return Request(sharing_ops.OpenShared(share_id=descriptor.share_id, device=descriptor.device, pool_fd=pool_fd),
                   convert)


def close_shared(descriptor: ShareDescriptor) -> Request[None]:
    return Request(sharing_ops.CloseShared(share_id=descriptor.share_id, device=descriptor.device), _nothing)


def revoke(descriptor: ShareDescriptor) -> Request[None]:
    """Withdraw a share this session exported: holders' next use of it raises :class:`Revoked`."""
    return Request(sharing_ops.Revoke(share_id=descriptor.share_id, device=descriptor.device), _nothing)


def revoke_buffer(buffer: OnDevice) -> Plan[None]:
    """Revoke the share of ``buffer`` (its descriptor is what ``export`` answers for it)."""
    descriptor = yield export(buffer)
    yield revoke(descriptor)


# --- the data plane: shared host buffers (their mapping: cuctxd.client.data_plane.host_buffers) --------------


def host_alloc(device: int | None, size: int, reuse: bool = False) -> Request[dict[str, Any]]:
    """Result: ``host`` (handle), ``size``, ``device`` and ``ticket``."""
    return Request(pinned_ops.HostAlloc(size=size, device=device, reuse=reuse), _result)


def shm_lane(device: int) -> Request[dict[str, Any]]:
    """Result: ``ticket`` (three fds on the fd channel) and ``size``."""
    return Request(pinned_ops.ShmLane(device=device), _result)


def host_free(host: OnDevice) -> Request[None]:
    return Request(pinned_ops.HostFree(host=host.handle, device=host.device), _nothing)


def memcpy_htod(buffer: OnDevice, host: OnDevice, offset: int, host_offset: int, size: int | None,
                stream: OnDevice | None) -> Request[int]:
    return Request(pinned_ops.MemcpyHtoD(buffer=buffer.handle, host=host.handle, offset=offset,
                                         host_offset=host_offset, size=size, device=buffer.device,
                                         stream=_handle(stream)), _size)


def memcpy_dtoh(buffer: OnDevice, host: OnDevice, offset: int, host_offset: int, size: int | None,
                stream: OnDevice | None) -> Request[int]:
    return Request(pinned_ops.MemcpyDtoH(buffer=buffer.handle, host=host.handle, offset=offset,
                                         host_offset=host_offset, size=size, device=buffer.device,
                                         stream=_handle(stream)), _size)


def stream_ordered(device: int, stream: int | None, entries: bytes) -> Request[dict[str, Any]]:
    """A batch of packed stream-ordered entries (:mod:`cuctxd.client.wire.stream_ordered`)."""
    return Request(ops.StreamOrdered(ops=entries, device=device, stream=stream), _result)

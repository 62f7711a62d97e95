"""Every op of protocol version 1: its name, arguments, where it runs, and what it returns.

Each class is an op's argument shape (see :mod:`cuctxd.protos.schema`); its docstring
is the op's short spec and states the result map. ``target="front"`` ops are
answered by the daemon's front thread; ``target="device"`` ops run on the
worker thread of the device named by ``device`` (or the session's current
device when ``device`` is omitted). PROTOCOL.md is the long form of this file.
"""

from __future__ import annotations

from cuctxd.protos.schema import count_field, handle_field, name_field, op, required_count

# --- session and daemon -----------------------------------------------------------


@op("hello", target="front", session=False)
class Hello:
    """Open a session. Result: ``session`` (token), ``session_id`` (public id),
    ``daemon_version``, ``protocol``, ``backend``, ``devices`` (list of device
    records), ``limits`` (map)."""

    protocol: int = required_count()
    client: str = ""
    pid: int = count_field(default=0)


@op("goodbye", target="front")
class Goodbye:
    """Close the session: destroy its contexts, free its allocations. Result: ``{}``."""


@op("ping", target="front", session=False)
class Ping:
    """Round trip; needs no session. Result: ``instance``, this daemon run's id (as ``hello`` gives it)."""


@op("device_count", target="front")
class DeviceCount:
    """Like ``cuDeviceGetCount``; creates no context. Result: ``count``."""


@op("devices", target="front")
class Devices:
    """Per-device records. Result: ``devices`` (list of device records)."""


@op("get_device", target="front")
class GetDevice:
    """Like ``cudaGetDevice``: the session's current device. Result: ``device``."""


@op("status", target="front")
class Status:
    """Daemon state: sessions and, per device, worker, primary context, contexts
    and allocations per session. Result: the status map (PROTOCOL.md)."""


# --- contexts ---------------------------------------------------------------------


@op("set_device", target="device")
class SetDevice:
    """Like ``cudaSetDevice``: make ``device`` current and bind its primary context
    (retained on first use) as the session's current context there. Result: ``context``."""

    device: int | None = count_field(default=None)


@op("current_context", target="device")
class CurrentContext:
    """Like ``cuCtxGetCurrent``; null while the session's stack on ``device`` is empty.
    Result: ``context`` (context record or null)."""

    device: int | None = count_field(default=None)


@op("context_stack", target="device")
class ContextStack:
    """The session's whole context stack on ``device``, bottom first. Result: ``stack``."""

    device: int | None = count_field(default=None)


@op("create_context", target="device")
class CreateContext:
    """Like ``cuCtxCreate``: a new context, pushed and current. Result: ``context``."""

    device: int | None = count_field(default=None)
    flags: int = count_field(default=0, maximum=0xFFFF_FFFF)


@op("push_context", target="device")
class PushContext:
    """Like ``cuCtxPushCurrent``. Result: ``context``."""

    context: int = handle_field()
    device: int | None = count_field(default=None)


@op("pop_context", target="device")
class PopContext:
    """Like ``cuCtxPopCurrent``; ``CUDA_ERROR_INVALID_CONTEXT`` on an empty stack.
    Result: ``context`` (the popped one)."""

    device: int | None = count_field(default=None)


@op("destroy_context", target="device")
class DestroyContext:
    """Like ``cuCtxDestroy``: frees its allocations, removes it from the stack.
    The primary context cannot be destroyed. Result: ``{}``."""

    context: int = handle_field()
    device: int | None = count_field(default=None)


@op("context_info", target="device")
class ContextInfo:
    """API version, flags, device and id of a context (``cuCtxGetApiVersion``,
    ``cuCtxGetFlags``, ``cuCtxGetDevice``, ``cuCtxGetId``). Result: ``context``."""

    context: int = handle_field()
    device: int | None = count_field(default=None)


@op("synchronize", target="device")
class Synchronize:
    """Like ``cuCtxSynchronize`` on the session's current context (binds the
    primary lazily). Result: ``{}``."""

    device: int | None = count_field(default=None)


@op("device_synchronize", target="device")
class DeviceSynchronize:
    """Synchronize every context alive on ``device``. Result: ``contexts`` (how many)."""

    device: int | None = count_field(default=None)


# --- memory -----------------------------------------------------------------------


@op("mem_get_info", target="device")
class MemGetInfo:
    """Like ``cuMemGetInfo`` in the current context (binds the primary lazily).
    Result: ``free``, ``total``."""

    device: int | None = count_field(default=None)


@op("alloc", target="device")
class Alloc:
    """Allocate in the session's current context on ``device`` (binds the primary lazily):
    from the device's stream-ordered pool (``cuMemAllocFromPoolAsync``), or with
    ``cuMemAlloc`` when ``shareable`` (only such buffers can be exported). ``version_of``: a shareable
    buffer for the next version of that name, its spare where it fits (PROTOCOL.md, "Versions").
    Result: ``buffer`` (buffer record); with ``version_of`` also ``buffer_id`` and ``buffers``."""

    size: int = required_count()
    device: int | None = count_field(default=None)
    shareable: bool = False
    version_of: str | None = name_field(default=None)


@op("free", target="device")
class Free:
    """Like ``cuMemFree``; the handle is invalid afterwards. Result: ``{}``."""

    buffer: int = handle_field()
    device: int | None = count_field(default=None)


@op("fill", target="device")
class Fill:
    """Like ``cuMemsetD8`` over ``[offset, offset+size)`` (``size`` defaults to the
    rest of the buffer). Result: ``size`` (bytes filled)."""

    buffer: int = handle_field()
    value: int = count_field(default=0, maximum=255)
    offset: int = count_field(default=0)
    size: int | None = count_field(default=None)
    device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)


@op("write", target="device", payload_in=True)
class Write:
    """Like ``cuMemcpyHtoD`` of the request's payload frame to ``buffer+offset``.
    Result: ``size`` (bytes written)."""

    buffer: int = handle_field()
    offset: int = count_field(default=0)
    device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)


@op("read", target="device", payload_out=True)
class Read:
    """Like ``cuMemcpyDtoH`` of ``[offset, offset+size)``; the bytes come back as
    the reply's payload frame. Result: ``size``."""

    buffer: int = handle_field()
    offset: int = count_field(default=0)
    size: int | None = count_field(default=None)
    device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)


@op("copy", target="device")
class Copy:
    """Device-to-device copy of ``size`` bytes from ``src+src_offset`` (on ``device``)
    to ``dst+dst_offset`` (on ``dst_device``, default the same device). Result: ``size``."""

    src: int = handle_field()
    dst: int = handle_field()
    size: int | None = count_field(default=None)
    src_offset: int = count_field(default=0)
    dst_offset: int = count_field(default=0)
    device: int | None = count_field(default=None)
    dst_device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)


@op("stream_ordered", target="device")
class StreamOrdered:
    """A batch of stream-ordered allocations and frees (``cuMemAllocFromPoolAsync``/``cuMemFreeAsync``)
    that the client sends without waiting: ``ops`` packs :data:`~cuctxd.protos.limits.STREAM_ORDERED_ENTRY`
    entries (alloc: a handle the client chose and a size; free: a handle). They run in order, on
    ``stream`` (default: the legacy stream of the current context). An entry that fails is
    recorded against its handle: the session's next request naming it answers that error, and so
    does its next synchronize on the device. Result: ``done`` (entries run), ``failed``."""

    ops: bytes
    device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)

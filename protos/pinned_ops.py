"""Ops on pinned host memory shared with the daemon (protocol version 1): host buffers, and DMA to and from them.

A *host buffer* is host memory both processes map: the daemon makes a memfd,
maps and page-locks it (``cuMemHostRegister``, portable), and hands the fd to the
client through the fd channel (``ticket`` in the reply; PROTOCOL.md, "The fd
channel"). Copies between a host buffer and a device buffer then carry no bytes on
the socket: ``memcpy_htod``/``memcpy_dtoh`` name both and the device's worker
copies by DMA. Host buffers belong to the session on the device they were made
for, count against ``host_memory_per_session`` there, and are freed with it.

An *shm lane* (``shm_lane``) carries a session's device ops to one device
through shared memory instead of the socket (:mod:`cuctxd.protos.shm_lane`).
"""

from __future__ import annotations

from cuctxd.protos.schema import count_field, handle_field, op, required_count


@op("host_alloc", target="device")
class HostAlloc:
    """Shared page-locked host memory of ``size`` bytes for use with ``device``'s buffers (binds the
    primary lazily). Result: ``host`` (handle), ``size``, ``device``, ``ticket`` (redeem it on the fd channel for
    the memfd to map, within ``fd_ticket_ttl``). ``reuse``: a buffer of the same size and uid the daemon kept
    registered may serve, with the bytes its last user left."""

    size: int = required_count(minimum=1)
    device: int | None = count_field(default=None)
    reuse: bool = False


@op("shm_lane", target="device")
class ShmLane:
    """Open this session's shm lane to ``device`` (one per session and device, closed with the
    session). Result: ``ticket`` (redeem it on the fd channel for three fds: the region's memfd, the
    request eventfd, the reply eventfd) and ``size`` (the region's bytes)."""

    device: int | None = count_field(default=None)


@op("host_free", target="device")
class HostFree:
    """Unregister and unmap the daemon's side of a host buffer, once copies queued on streams
    that use it have passed; the handle is invalid afterwards. Result: ``{}``."""

    host: int = handle_field()
    device: int | None = count_field(default=None)


@op("memcpy_htod", target="device")
class MemcpyHtoD:
    """Like ``cuMemcpyHtoD`` from ``host+host_offset`` to ``buffer+offset``, ``size`` bytes
    (default: the rest of the host buffer). Without ``stream`` it returns once the host bytes may
    be reused; with one it returns once the copy is queued (``cuMemcpyHtoDAsync``): the host bytes
    must not change until the stream passes it. Result: ``size``."""

    buffer: int = handle_field()
    host: int = handle_field()
    offset: int = count_field(default=0)
    host_offset: int = count_field(default=0)
    size: int | None = count_field(default=None)
    device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)


@op("memcpy_dtoh", target="device")
class MemcpyDtoH:
    """Like ``cuMemcpyDtoH`` from ``buffer+offset`` to ``host+host_offset``, ``size`` bytes (default:
    the rest of the host buffer). Without ``stream`` the bytes are in the host buffer when the reply
    comes; with one, once the stream passes the copy (``cuMemcpyDtoHAsync``). Result: ``size``."""

    buffer: int = handle_field()
    host: int = handle_field()
    offset: int = count_field(default=0)
    host_offset: int = count_field(default=0)
    size: int | None = count_field(default=None)
    device: int | None = count_field(default=None)
    stream: int | None = handle_field(default=None)

"""Every call of both clients, defined once: its parameters, its docstring and the request or plan it runs.

Each function takes the client (either flavour, :data:`~cuctxd.client.data_plane.owner.Owner`), the client's
:class:`~cuctxd.client.api.flavours.Family` (the classes its answers are: ``Buffer`` or ``AsyncBuffer``, ...)
and the caller's arguments, and returns what :class:`~cuctxd.client.api.client.Client` runs and
:class:`~cuctxd.client.api.async_client.AsyncClient` awaits (:mod:`cuctxd.client.api.flavours` makes the
methods). The requests themselves are built in :mod:`cuctxd.client.wire.build`. Calls that are not one
request or plan (``alloc_async``'s outbox, ``close``, ``pipeline``) are written in each client.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from cuctxd.client.api.flavours import Family
from cuctxd.client.api.objects import BufferFields, ContextFields
from cuctxd.client.api.sharing import MappedShare, open_share
from cuctxd.client.api.streams import HandleFields
from cuctxd.client.data_plane import host_buffers, transfers
from cuctxd.client.data_plane.host_buffers import HostBufferFields
from cuctxd.client.data_plane.owner import Owner
from cuctxd.client.wire import build
from cuctxd.client.wire.build import Plan, Request, SharedPage
from cuctxd.protos.records import DeviceInfo, ShareDescriptor

ContextT = TypeVar("ContextT", bound=ContextFields)
BufferT = TypeVar("BufferT", bound=BufferFields)
StreamT = TypeVar("StreamT", bound=HandleFields)
EventT = TypeVar("EventT", bound=HandleFields)
ShareT = TypeVar("ShareT", bound=MappedShare)
HostT = TypeVar("HostT", bound=HostBufferFields)

# A family as a call sees it: only the classes it builds or takes (``Buffers[BufferT]``: its buffers' class).
Contexts = Family[ContextT, object, object, object, object, object]
Buffers = Family[object, BufferT, object, object, object, object]
BufferStreams = Family[object, BufferT, StreamT, object, object, object]
Streams = Family[object, object, StreamT, object, object, object]
Events = Family[object, object, object, EventT, object, object]
Shares = Family[object, object, object, object, ShareT, object]
HostBuffers = Family[object, object, object, object, object, HostT]

# --- daemon and devices -----------------------------------------------------------


def ping(client: Owner, family: object) -> Plan[float]:
    """Round-trip time in seconds."""
    start = time.perf_counter()
    yield build.ping()
    return time.perf_counter() - start


def device_count(client: Owner, family: object) -> Request[int]:
    """``cudaGetDeviceCount``: creates no context."""
    return build.device_count()


def devices(client: Owner, family: object) -> Request[list[DeviceInfo]]:
    """Every device the daemon serves, with its name, UUID, memory and compute capability."""
    return build.devices()


def status(client: Owner, family: object) -> Request[dict[str, Any]]:
    """The daemon's sessions, devices, contexts, memory and limits, as ``cuctx status`` shows them."""
    return build.status()


def close_session(client: Owner, family: object, session_id: int) -> Request[None]:
    """Close the session ``session_id`` (its public id, as ``status`` lists it) as its ``goodbye``
    would: allowed to that session's user and the daemon's own user."""
    return build.close_session(session_id)


def shutdown(client: Owner, family: object) -> Request[None]:
    """Ask the daemon to shut down as SIGTERM does (drain, then exit): only its own user may."""
    return build.shutdown()


def get_device(client: Owner, family: object) -> Request[int]:
    """``cudaGetDevice``: the session's current device."""
    return build.get_device()


def set_device(client: Owner, family: Contexts[ContextT], device: int) -> Request[ContextT]:
    """``cudaSetDevice``: binds the device's primary context as current; returns it."""
    return build.set_device(client, family.context, device)


# --- contexts -------------------------------------------------------------------


def current_context(client: Owner, family: Contexts[ContextT], device: int | None = None) -> Request[ContextT | None]:
    """``cuCtxGetCurrent``; None while the session's stack on ``device`` is empty."""
    return build.current_context(client, family.context, device)


def context_stack(client: Owner, family: Contexts[ContextT], device: int | None = None) -> Request[list[ContextT]]:
    """The session's context stack on ``device``, bottom first."""
    return build.context_stack(client, family.context, device)


def create_context(client: Owner, family: Contexts[ContextT], device: int | None = None,
                   flags: int = 0) -> Request[ContextT]:
    """``cuCtxCreate``: a new context, pushed and current on ``device``."""
    return build.create_context(client, family.context, device, flags)


def push_context(client: Owner, family: Contexts[ContextT], context: ContextT) -> Request[None]:
    """``cuCtxPushCurrent``: make ``context`` the session's current context on its device."""
    return build.push_context(context)


def pop_context(client: Owner, family: Contexts[ContextT], device: int | None = None) -> Request[ContextT]:
    """``cuCtxPopCurrent``: returns the popped context."""
    return build.pop_context(client, family.context, device)


def destroy_context(client: Owner, family: Contexts[ContextT], context: ContextT) -> Request[None]:
    """``cuCtxDestroy``: frees every buffer allocated in it."""
    return build.destroy_context(context)


def context_info(client: Owner, family: Contexts[ContextT], context: ContextT) -> Request[ContextT]:
    """Fresh ``api_version``/``flags``/``device`` of ``context`` as the driver reports them now."""
    return build.context_info(client, family.context, context)


def synchronize(client: Owner, family: object, device: int | None = None) -> Request[None]:
    """``cuCtxSynchronize`` on the current context (binds the primary if there is none)."""
    return build.synchronize(device)


def device_synchronize(client: Owner, family: object, device: int | None = None) -> Request[None]:
    """Wait for every context alive on ``device``, this session's and others'."""
    return build.device_synchronize(device)


# --- memory ---------------------------------------------------------------------


def mem_get_info(client: Owner, family: object, device: int | None = None) -> Request[tuple[int, int]]:
    """``cuMemGetInfo``: (free, total) bytes."""
    return build.mem_get_info(device)


def memory_info(client: Owner, family: object, device: int | None = None) -> Request[dict[str, Any]]:
    """The whole ``mem_get_info`` answer: ``free`` and ``total`` as this session sees them,
    plus ``device_free``, ``quota``, ``reserve`` and ``limited_by`` ("quota" or "device")."""
    return build.memory_info(device)


def alloc(client: Owner, family: Buffers[BufferT], size: int, device: int | None = None, *,
          shareable: bool = False) -> Request[BufferT]:
    """Device memory in the current context of ``device`` (default: the current device).

    By default it comes from the context's stream-ordered pool (fast), never exported; pass
    ``shareable=True`` for memory other processes can open: a VMM allocation of its own, of at least
    the device's granularity (2 MiB), where the GPU has VMM (PROTOCOL.md, section 7, "Buffers").
    """
    return build.alloc(client, family.buffer, size, device, shareable)


def free(client: Owner, family: Buffers[BufferT], buffer: BufferT) -> Request[None] | Plan[None]:
    """``cuMemFree``, once: freeing a buffer again (``buffer.free()`` or this) sends nothing."""
    return build.free(buffer)


def host_alloc(client: Owner, family: HostBuffers[HostT], size: int, device: int | None = None, *,
               reuse: bool = False) -> Plan[HostT]:
    """Host memory shared with the daemon and page-locked there, for copies with ``device``'s buffers
    (default: the current device) that carry no bytes on the socket; needs the fd channel (ipc://).
    Counts against the session's ``host_memory_per_session``; the host buffer's ``free`` gives it back.
    ``reuse``: a buffer of the same size the daemon kept page-locked after a session of this user freed it
    may serve (no new page-locking: 0.5 ms a MiB), its bytes as that session left them."""
    return host_buffers.host_alloc(client, family.host, size, device, reuse)


def fill(client: Owner, family: BufferStreams[BufferT, StreamT], buffer: BufferT, value: int = 0, offset: int = 0,
         size: int | None = None, *, stream: StreamT | None = None) -> Request[int]:
    """``cuMemsetD8`` over ``buffer[offset:offset+size]`` (async on ``stream`` if given); returns bytes filled."""
    return build.fill(buffer, value, offset, size, stream)


def write(client: Owner, family: BufferStreams[BufferT, StreamT], buffer: BufferT, data: Any, offset: int = 0, *,
          stream: StreamT | None = None) -> Plan[int]:
    """Host to device (any buffer-protocol object, or a host buffer by DMA) into ``buffer[offset:]``; returns
    bytes written. Large writes go through the staging ring or as pipelined chunks, so the transfer of one
    chunk overlaps the device copy of the one before (:mod:`cuctxd.client.data_plane.transfers`)."""
    return transfers.write(client, buffer, data, offset, stream)


def read(client: Owner, family: BufferStreams[BufferT, StreamT], buffer: BufferT, size: int | None = None,
         offset: int = 0, *, stream: StreamT | None = None) -> Plan[bytes]:
    """Device to host: ``size`` bytes (default: to the end) from ``buffer[offset:]``."""
    return transfers.read(client, buffer, size, offset, stream)


def read_into(client: Owner, family: BufferStreams[BufferT, StreamT], buffer: BufferT, out: Any, offset: int = 0, *,
              stream: StreamT | None = None) -> Plan[int]:
    """Device to host straight into ``out`` (a writable host buffer: ``recv_into``, or a host buffer by DMA),
    in pipelined chunks when large; returns bytes read."""
    return transfers.read_into(client, buffer, out, offset, stream)


def copy(client: Owner, family: BufferStreams[BufferT, StreamT], src: BufferT, dst: BufferT, size: int | None = None,
         src_offset: int = 0, dst_offset: int = 0, *, stream: StreamT | None = None) -> Request[int]:
    """Device to device, from ``src`` into ``dst`` (any device); returns bytes copied."""
    return build.copy(src, dst, size, src_offset, dst_offset, stream)


# --- streams and events -----------------------------------------------------------------


def create_stream(client: Owner, family: Streams[StreamT], device: int | None = None, *,
                  non_blocking: bool = False) -> Request[StreamT]:
    """``cuStreamCreate`` in the current context of ``device`` (binds the primary lazily)."""
    return build.create_stream(client, family.stream, device, non_blocking)


def create_event(client: Owner, family: Events[EventT], device: int | None = None, *,
                 timing: bool = True) -> Request[EventT]:
    """``cuEventCreate`` in the current context of ``device``; ``timing=False`` events cannot measure time."""
    return build.create_event(client, family.event, device, timing)


# --- sharing between processes --------------------------------------------------------


def export(client: Owner, family: Buffers[BufferT], buffer: BufferT) -> Request[ShareDescriptor]:
    """Make ``buffer`` shareable; the descriptor is plain data another process can open."""
    return build.export(buffer)


def publish(client: Owner, family: Buffers[BufferT], buffer: BufferT, name: str, *, persistent: bool = False,
            once: bool = False, read_only: bool = False, replace: bool = False,
            version: bool = False) -> Request[ShareDescriptor]:
    """Export ``buffer`` and publish it under ``name`` for every session to look up. The name keeps the
    buffer until it is unpublished or, once this session let the buffer go and nobody holds it, the
    daemon's ``orphan_ttl`` passes; ``persistent``: no ``orphan_ttl`` (and the name survives a daemon
    restart where a service manager keeps it); ``once``: consume-once, the name stops keeping the
    buffer once a session opened it after its owner let go (PROTOCOL.md, "Lifetime of shared memory");
    ``read_only``: openers map it without write access (advisory: section 9 of PROTOCOL.md says where
    it holds); ``replace``: a name in use moves to ``buffer`` at once, if this session may unpublish it
    (sessions holding the old buffer keep it); ``version``: the name's next version (its number in the
    descriptor's ``version``), handed to the name: ``buffer`` counts as freed here (PROTOCOL.md, "Versions")."""
    return build.publish(buffer, name, persistent=persistent, read_only=read_only, once=once, replace=replace,
                         version=version)


def unpublish(client: Owner, family: object, name: str, *, device: int | None = None) -> Request[None]:
    """Remove a name published by this user's sessions (any name, as the daemon's own user): every copy of it,
    or with ``device`` only its copy there."""
    return build.unpublish(name, device)


def lookup(client: Owner, family: object, name: str, *, digest: str | None = None, device: int | None = None,
           version: int | None = None) -> Request[ShareDescriptor] | Plan[ShareDescriptor]:
    """The descriptor published as ``name`` (its copy on ``device``; else its first); with ``digest``, only once
    the daemon vouches that the name's layout has that digest (``verify_shared``):
    :class:`~cuctxd.protos.errors.DigestMismatch` otherwise; ``version``: that live version of a versioned
    name instead of its current one."""
    return build.lookup(name, device, version) if digest is None else build.lookup_verified(name, digest, device)


def wait_version(client: Owner, family: object, name: str, after: int, timeout: float | None = None) -> Plan[int]:
    """Wait until ``name`` has a version newer than ``after`` and return its number: the daemon answers
    when it is published (no polling here); :class:`~cuctxd.protos.errors.TimedOut` (a TimeoutError) after
    ``timeout`` seconds. A sync client's other calls wait meanwhile (wait on a client of its own); an async
    client's go on."""
    return build.wait_version(name, after, timeout)


def verify_shared(client: Owner, family: object, name: str, digest: str, device: int) -> Request[dict[str, Any]]:
    """Have the daemon vouch for ``name``'s layout digest on ``device`` before relying on it: at once for a
    name of this user's, else once it hashed the bytes (the first reliance only). Returns ``digest``,
    ``verified`` (``"publisher"`` or ``"daemon"``) and ``hashed``; raises
    :class:`~cuctxd.protos.errors.DigestMismatch` for another digest, or bytes that differ from it."""
    return build.verify_shared(name, digest, device)


def list_shared(client: Owner, family: object, *, prefix: str | None = None, owner: int | None = None,
                uid: int | None = None) -> Plan[list[dict[str, Any]]]:
    """Published names with their device, size, owner and number of holders, in name order, all of them
    page after page: those starting with ``prefix``, published by session ``owner`` (public id), by ``uid``."""
    return build.list_shared(prefix, owner, uid)


def shared_page(client: Owner, family: object, *, limit: int | None = None, after: str | None = None,
                prefix: str | None = None, owner: int | None = None, uid: int | None = None) -> Request[SharedPage]:
    """One page of ``list_shared``: at most ``limit`` names after the name ``after`` (the last page's
    ``next``)."""
    return build.shared_page(limit, after, prefix, owner, uid)


def open_shared(client: Owner, family: Shares[ShareT], share: str | ShareDescriptor) -> Plan[ShareT]:
    """Hold a share (by name or descriptor) and map it in this process (local work); close the share when done
    (``with``; ``await share.close()`` or ``async with`` for an async client's)."""
    return open_share(client, family.share, share)


def close_shared(client: Owner, family: object, descriptor: ShareDescriptor) -> Request[None]:
    """Drop this session's hold (an opened share's ``close`` calls this after unmapping)."""
    return build.close_shared(descriptor)


def revoke(client: Owner, family: Buffers[BufferT], share: BufferT | ShareDescriptor) -> Request[None] | Plan[None]:
    """Withdraw a share this session exported (by buffer or descriptor): its names go, holders
    lose their holds and get ``Revoked`` on their next use of it."""
    return build.revoke(share) if isinstance(share, ShareDescriptor) else build.revoke_buffer(share)

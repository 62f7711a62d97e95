"""Client-side objects named after CUDA's: :class:`Context` and :class:`Buffer`, and their async twins.

They are thin: each holds the record the daemon gave out
(:mod:`cuctxd.protos.records`) and the client that runs its requests; the daemon
holds the state. ``handle`` and ``device`` (and a buffer's ``size``) are copied
from the record into slots, since every request reads them; the rest is read
from the record. :class:`Context`/:class:`Buffer` belong to a
:class:`~cuctxd.client.api.client.Client` and their methods return results, while
:class:`AsyncContext`/:class:`AsyncBuffer` belong to an
:class:`~cuctxd.client.api.async_client.AsyncClient` and their methods are coroutines
(``await buf.write(data)``). Both are typed against the data plane's client
protocols (:mod:`cuctxd.client.data_plane.owner`), not the client classes.
"""

from __future__ import annotations

from typing import Any, Self

from cuctxd.client.data_plane import transfers
from cuctxd.client.data_plane.owner import AsyncOwner, Owner, SyncOwner
from cuctxd.client.presentation import describe, docs_from
from cuctxd.client.wire import build
from cuctxd.protos.records import BufferRecord, ContextRecord, ShareDescriptor


class SessionObject:
    """A session-scoped handle on one device, with the client that made it.

    Two are equal when they are the same kind, of the same client, with the same record.
    """

    __slots__ = ("client", "device", "handle")

    client: Owner
    handle: int
    device: int

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and isinstance(other, SessionObject) and other.client is self.client
                and other._fields() == self._fields())

    def __hash__(self) -> int:
        return hash((type(self), self.handle, self.device))

    def __repr__(self) -> str:
        return describe(type(self).__name__, self._fields())


class ContextFields(SessionObject):
    """What :class:`Context` and :class:`AsyncContext` hold: the record ``create_context`` and friends return."""

    __slots__ = ("record",)

    def __init__(self, client: Owner, record: ContextRecord) -> None:
        self.client = client
        self.record = record
        self.handle = record.handle
        self.device = record.device

    @classmethod
    def from_wire(cls, client: Owner, wire: dict[str, Any]) -> Self:
        return cls(client, ContextRecord.from_wire(wire))

    def _fields(self) -> dict[str, Any]:
        return self.record.to_wire()

    @property
    def is_primary(self) -> bool:
        return self.record.is_primary

    @property
    def api_version(self) -> int:
        return self.record.api_version

    @property
    def flags(self) -> int:
        return self.record.flags

    @property
    def context_id(self) -> int:
        return self.record.context_id


class Context(ContextFields):
    """A CUDA context as this session names it (``handle`` means nothing to other sessions)."""

    __slots__ = ()
    client: SyncOwner

    def push(self) -> None:
        """``cuCtxPushCurrent``: make this the session's current context on its device."""
        self.client.run(build.push_context(self))

    def destroy(self) -> None:
        """``cuCtxDestroy``: frees every buffer allocated in it."""
        self.client.run(build.destroy_context(self))

    def info(self) -> Context:
        """Fresh ``api_version``/``flags``/``device`` as the driver reports them now."""
        return self.client.run(build.context_info(self.client, Context, self))


@docs_from(Context)
class AsyncContext(ContextFields):
    """A :class:`Context` of an :class:`~cuctxd.client.api.async_client.AsyncClient`: its methods are coroutines."""

    __slots__ = ()
    client: AsyncOwner

    async def push(self) -> None:
        await self.client.run(build.push_context(self))

    async def destroy(self) -> None:
        await self.client.run(build.destroy_context(self))

    async def info(self) -> AsyncContext:
        return await self.client.run(build.context_info(self.client, AsyncContext, self))


class BufferFields(SessionObject):
    """What :class:`Buffer` and :class:`AsyncBuffer` hold: the record ``alloc`` returns, and whether it was freed.

    ``freed`` turns True once a ``free`` of it is answered, by either route
    (``buf.free()`` or ``client.free(buf)``); freeing it again then sends nothing.
    """

    __slots__ = ("freed", "record", "size")

    def __init__(self, client: Owner, record: BufferRecord) -> None:
        self.client = client
        self.record = record
        self.handle = record.handle
        self.device = record.device
        self.size = record.size
        self.freed = False

    @classmethod
    def from_wire(cls, client: Owner, wire: dict[str, Any]) -> Self:
        return cls(client, BufferRecord.from_wire(wire))

    def _fields(self) -> dict[str, Any]:
        return {**self.record.to_wire(), "freed": self.freed}

    @property
    def context(self) -> int:
        """The handle of the context it was allocated in."""
        return self.record.context

    @property
    def shareable(self) -> bool:
        return self.record.shareable


class Buffer(BufferFields):
    """Device memory owned by this session; freed by :meth:`free` or when the session ends."""

    __slots__ = ()
    client: SyncOwner

    def write(self, data: Any, offset: int = 0, *, stream: build.OnDevice | None = None) -> int:
        """Copy host bytes (any buffer-protocol object, or a host buffer by DMA) to ``self[offset:]``;
        returns bytes written."""
        return self.client.run(transfers.write(self.client, self, data, offset, stream))

    def read(self, size: int | None = None, offset: int = 0, *, stream: build.OnDevice | None = None) -> bytes:
        """Copy ``size`` bytes (default: to the end) from ``self[offset:]`` to the host."""
        return self.client.run(transfers.read(self.client, self, size, offset, stream))

    def read_into(self, out: Any, offset: int = 0, *, stream: build.OnDevice | None = None) -> int:
        """Read ``len(out)`` bytes straight into a writable host buffer; returns bytes read."""
        return self.client.run(transfers.read_into(self.client, self, out, offset, stream))

    def fill(self, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: build.OnDevice | None = None) -> None:
        """``cuMemsetD8`` over ``[offset, offset+size)`` (async on ``stream`` if given)."""
        self.client.run(build.fill(self, value, offset, size, stream))

    def copy_to(self, dst: Buffer, size: int | None = None, src_offset: int = 0, dst_offset: int = 0, *,
                stream: build.OnDevice | None = None) -> int:
        """Device-to-device copy into ``dst`` (any device); returns bytes copied."""
        return self.client.run(build.copy(self, dst, size, src_offset, dst_offset, stream))

    def export(self) -> ShareDescriptor:
        """Make this buffer shareable with other processes (see ``Client.open_shared``)."""
        return self.client.run(build.export(self))

    def publish(self, name: str) -> ShareDescriptor:
        return self.client.run(build.publish(self, name))

    def revoke(self) -> None:
        """Withdraw this buffer's share: its names go, holders lose their holds and get
        :class:`~cuctxd.protos.errors.Revoked` on their next use; the buffer stays yours."""
        self.client.run(build.revoke_buffer(self))

    def free(self) -> None:
        """Free it once; later calls (also ``client.free(buf)``) send nothing."""
        self.client.run(build.free(self))

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


@docs_from(Buffer)
class AsyncBuffer(BufferFields):
    """A :class:`Buffer` of an :class:`~cuctxd.client.api.async_client.AsyncClient`: its methods are coroutines,
    and ``async with`` frees it."""

    __slots__ = ()
    client: AsyncOwner

    async def write(self, data: Any, offset: int = 0, *, stream: build.OnDevice | None = None) -> int:
        return await self.client.run(transfers.write(self.client, self, data, offset, stream))

    async def read(self, size: int | None = None, offset: int = 0, *,
                   stream: build.OnDevice | None = None) -> bytes:
        return await self.client.run(transfers.read(self.client, self, size, offset, stream))

    async def read_into(self, out: Any, offset: int = 0, *, stream: build.OnDevice | None = None) -> int:
        return await self.client.run(transfers.read_into(self.client, self, out, offset, stream))

    async def fill(self, value: int = 0, offset: int = 0, size: int | None = None, *,
                   stream: build.OnDevice | None = None) -> None:
        await self.client.run(build.fill(self, value, offset, size, stream))

    async def copy_to(self, dst: AsyncBuffer, size: int | None = None, src_offset: int = 0, dst_offset: int = 0,
                      *, stream: build.OnDevice | None = None) -> int:
        return await self.client.run(build.copy(self, dst, size, src_offset, dst_offset, stream))

    async def export(self) -> ShareDescriptor:
        return await self.client.run(build.export(self))

    async def publish(self, name: str) -> ShareDescriptor:
        return await self.client.run(build.publish(self, name))

    async def revoke(self) -> None:
        await self.client.run(build.revoke_buffer(self))

    async def free(self) -> None:
        await self.client.run(build.free(self))

    async def __aenter__(self) -> AsyncBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.free()

"""Client-side objects named after CUDA's: :class:`Context` and :class:`Buffer`, and their async twins.

They are thin: each holds the session-scoped handle the daemon gave out and
calls back into its client; the daemon holds the state. The fields live in one
base per concept; :class:`Context`/:class:`Buffer` belong to a
:class:`~cuctxd.client.client.Client` and their methods return results, while
:class:`AsyncContext`/:class:`AsyncBuffer` belong to an
:class:`~cuctxd.client.async_client.AsyncClient` and their methods are coroutines
(``await buf.write(data)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, TypeVar

from cuctxd.protos.records import BufferRecord, ContextRecord, ShareDescriptor

if TYPE_CHECKING:
    from cuctxd.client.async_client import AsyncClient
    from cuctxd.client.client import Client
    from cuctxd.client.streams import AsyncStream, Stream

ClassT = TypeVar("ClassT", bound=type)


def docs_from(twin: type) -> Callable[[ClassT], ClassT]:
    """Give an async class's undocumented methods the docstrings of its sync twin's namesakes."""

    def borrow(cls: ClassT) -> ClassT:
        for name, member in vars(cls).items():
            source = getattr(twin, name, None)
            if callable(member) and member.__doc__ is None and source is not None:
                member.__doc__ = source.__doc__
        return cls

    return borrow


@dataclass(frozen=True)
class ContextFields:
    """What :class:`Context` and :class:`AsyncContext` hold: the record ``create_context`` and friends return."""

    client: Any = field(repr=False, compare=False)
    handle: int
    device: int
    is_primary: bool
    api_version: int
    flags: int
    context_id: int

    @classmethod
    def from_wire(cls, client: Any, wire: dict[str, Any]) -> Self:
        record = ContextRecord.from_wire(wire)
        return cls(client, record.handle, record.device, record.is_primary, record.api_version,
                   record.flags, record.context_id)


class Context(ContextFields):
    """A CUDA context as this session names it (``handle`` means nothing to other sessions)."""

    client: Client

    def push(self) -> None:
        """``cuCtxPushCurrent``: make this the session's current context on its device."""
        self.client.push_context(self)

    def destroy(self) -> None:
        """``cuCtxDestroy``: frees every buffer allocated in it."""
        self.client.destroy_context(self)

    def info(self) -> Context:
        """Fresh ``api_version``/``flags``/``device`` as the driver reports them now."""
        return self.client.context_info(self)


@docs_from(Context)
class AsyncContext(ContextFields):
    """A :class:`Context` of an :class:`~cuctxd.client.async_client.AsyncClient`: its methods are coroutines."""

    client: AsyncClient

    async def push(self) -> None:
        await self.client.push_context(self)

    async def destroy(self) -> None:
        await self.client.destroy_context(self)

    async def info(self) -> AsyncContext:
        return await self.client.context_info(self)


@dataclass
class BufferFields:
    """What :class:`Buffer` and :class:`AsyncBuffer` hold: the record ``alloc`` returns, and whether it was freed."""

    client: Any = field(repr=False)
    handle: int
    device: int
    size: int
    context: int
    shareable: bool = False
    freed: bool = False

    @classmethod
    def from_wire(cls, client: Any, wire: dict[str, Any]) -> Self:
        record = BufferRecord.from_wire(wire)
        return cls(client, record.handle, record.device, record.size, record.context, record.shareable)


class Buffer(BufferFields):
    """Device memory owned by this session; freed by :meth:`free` or when the session ends."""

    client: Client

    def write(self, data: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Copy host bytes (any buffer-protocol object) to ``self[offset:]``; returns bytes written."""
        return self.client.write(self, data, offset, stream=stream)

    def read(self, size: int | None = None, offset: int = 0, *, stream: Stream | None = None) -> bytes:
        """Copy ``size`` bytes (default: to the end) from ``self[offset:]`` to the host."""
        return self.client.read(self, size, offset, stream=stream)

    def read_into(self, out: Any, offset: int = 0, *, stream: Stream | None = None) -> int:
        """Read ``len(out)`` bytes straight into a writable host buffer; returns bytes read."""
        return self.client.read_into(self, out, offset, stream=stream)

    def fill(self, value: int = 0, offset: int = 0, size: int | None = None, *,
             stream: Stream | None = None) -> None:
        """``cuMemsetD8`` over ``[offset, offset+size)`` (async on ``stream`` if given)."""
        self.client.fill(self, value, offset, size, stream=stream)

    def copy_to(self, dst: Buffer, size: int | None = None, src_offset: int = 0, dst_offset: int = 0, *,
                stream: Stream | None = None) -> int:
        """Device-to-device copy into ``dst`` (any device); returns bytes copied."""
        return self.client.copy(self, dst, size, src_offset, dst_offset, stream=stream)

    def export(self) -> ShareDescriptor:
        """Make this buffer shareable with other processes (see ``Client.open_shared``)."""
        return self.client.export(self)

    def publish(self, name: str) -> ShareDescriptor:
        return self.client.publish(self, name)

    def free(self) -> None:
        """Free it once; later calls send nothing."""
        if not self.freed:
            self.client.free(self)
            self.freed = True

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


@docs_from(Buffer)
class AsyncBuffer(BufferFields):
    """A :class:`Buffer` of an :class:`~cuctxd.client.async_client.AsyncClient`: its methods are coroutines,
    and ``async with`` frees it."""

    client: AsyncClient

    async def write(self, data: Any, offset: int = 0, *, stream: AsyncStream | None = None) -> int:
        return await self.client.write(self, data, offset, stream=stream)

    async def read(self, size: int | None = None, offset: int = 0, *, stream: AsyncStream | None = None) -> bytes:
        return await self.client.read(self, size, offset, stream=stream)

    async def read_into(self, out: Any, offset: int = 0, *, stream: AsyncStream | None = None) -> int:
        return await self.client.read_into(self, out, offset, stream=stream)

    async def fill(self, value: int = 0, offset: int = 0, size: int | None = None, *,
                   stream: AsyncStream | None = None) -> None:
        await self.client.fill(self, value, offset, size, stream=stream)

    async def copy_to(self, dst: AsyncBuffer, size: int | None = None, src_offset: int = 0, dst_offset: int = 0,
                      *, stream: AsyncStream | None = None) -> int:
        return await self.client.copy(self, dst, size, src_offset, dst_offset, stream=stream)

    async def export(self) -> ShareDescriptor:
        return await self.client.export(self)

    async def publish(self, name: str) -> ShareDescriptor:
        return await self.client.publish(self, name)

    async def free(self) -> None:
        if not self.freed:
            await self.client.free(self)
            self.freed = True

    async def __aenter__(self) -> AsyncBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.free()
